"""Files written so that a reader sees the old content or the new, never a torn one."""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, fsync it, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, _new_file_mode())  # mkstemp makes 0600; the file should look like one open() created
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@functools.cache  # the umask is read once: reading it means setting it, which other threads would see
def fsync_path(path: Path | str) -> None:
    """fsync a file or a directory (a directory's fsync makes the names created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_json_atomic(path: Path, data: Any, indent: int | None = 2) -> None:
    """`data` as JSON, written atomically (see `write_file_atomic`)."""
    write_file_atomic(Path(path), json.dumps(data, indent=indent).encode())
