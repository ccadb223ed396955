"""The package's one logger: `neurontrain: message` lines on stderr, informational ones from rank 0 only.

Every module logs through `get_logger(__name__)`. Under torchrun every worker runs the same code, so an
informational line would otherwise appear once per worker; warnings and errors of other ranks still show,
prefixed with their rank, because they are usually what tells a hang or a crash apart.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "neurontrain"


def process_rank() -> int:
    """This process's global rank under torchrun (RANK), 0 outside a distributed launch."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def is_rank_zero() -> bool:
    return process_rank() == 0


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = process_rank()
        if rank == 0:
            return True
        if record.levelno < logging.WARNING:
            return False
        record.msg = f"rank {rank}: {record.msg}"
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to the current sys.stderr (not the one at set-up), so redirected or captured stderr works."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # not setStream: it flushes the previous stream, which may be closed by now
        super().emit(record)


def get_logger(name: str = ROOT) -> logging.Logger:
    """The package logger (or a child of it for `name` = a module's `__name__`), set up on first use."""
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("neurontrain: %(message)s"))
        handler.addFilter(_RankFilter())
        root.addHandler(handler)
        root.setLevel(logging.DEBUG if os.environ.get("NEURONTRAIN_DEBUG") else logging.INFO)
        root.propagate = False
    return logging.getLogger(name) if name.startswith(ROOT) else root
