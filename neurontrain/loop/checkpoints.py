"""Training checkpoints: atomic directories with a completion marker, keep-last-N, resume from the newest.

Layout: <root>/step_00000020/{state.pt, meta.json, COMPLETE}. A checkpoint is written into
<root>/.step_00000020.partial/ and renamed into place only after every file is on disk and the marker is
written, so a kill at any moment leaves either the old set of checkpoints or the new one. What state.pt and
meta.json hold is the trainer's to say (`Trainer.state_dict`, `Trainer.load_state_dict`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MARKER = "COMPLETE"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def steps_to_prune(steps: list[int], keep: int) -> list[int]:
    """Pure: which complete checkpoints to delete so that only the newest `keep` remain."""
    ordered = sorted(steps)
    return ordered[:-keep] if keep > 0 and len(ordered) > keep else []


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint under `root` with its marker and state, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_dir() and (entry / MARKER).is_file() and (entry / STATE_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def remove_partial(root: Path) -> list[str]:
    """Delete leftovers of interrupted writes (and step dirs without a marker)."""
    removed = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if entry.name.endswith(".partial") or (_NAME.match(entry.name) and not (entry / MARKER).is_file()):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: Path,
    step: int,
    state: dict,
    meta: dict,
    keep: int,
    save_fn: Callable[[Any, str], None],
    is_master: bool = True,
    all_ranks_save: bool = True,
) -> Path | None:
    """Write `state` with save_fn (xm.save on XLA: CPU tensors, master only), then publish atomically.
    all_ranks_save: every rank calls save_fn (a collective, such as xm.save across xla workers)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    partial = root / f".{checkpoint_name(step)}.partial"
    if is_master:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    if not is_master and not all_ranks_save:
        return None
    save_fn(state, str(partial / STATE_FILE))  # collective on XLA: every rank calls it
    if not is_master:
        return None
    (partial / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    for name in (STATE_FILE, META_FILE):
        _fsync_path(partial / name)
    with open(partial / MARKER, "w") as fh:
        fh.write(f"{step}\n")
        fh.flush()
        os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(partial, final)
    _fsync_path(root)
    by_step = dict(complete_checkpoints(root))
    for old in steps_to_prune(list(by_step), keep):
        shutil.rmtree(by_step[old], ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> tuple[dict, dict]:
    """(state, meta) of a complete checkpoint directory, tensors on the CPU."""
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    meta = json.loads((path / META_FILE).read_text())
    return state, meta
