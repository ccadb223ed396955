"""Every process a launcher started, found and ended: a marker variable (`NEURONTRAIN_RUN_ID`) is set in the
environment of what it starts, every descendant inherits it, and /proc/PID/environ shows it even after a
process was re-parented to init or moved to its own session (torchrun starts each worker in one).

Ending them: SIGTERM, then SIGCONT (a stopped process, e.g. by SIGSTOP, holds SIGTERM pending until it is
continued), then SIGKILL to whatever is left after a grace period (SIGKILL reaches a stopped process too).
Linux only (/proc); elsewhere nothing is found.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

MARKER = "NEURONTRAIN_RUN_ID"
_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def new_marker() -> dict[str, str]:
    """The environment entry that marks the processes of one launch."""
    return {MARKER: uuid.uuid4().hex}


def _stat(pid: int) -> tuple[str, int]:
    """(state, parent pid) from /proc/PID/stat; ("", 0) when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[-1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return "", 0


def proc_state(pid: int) -> str:
    """R/S/D (running or waiting), T (stopped, e.g. SIGSTOP), Z or "" (dead)."""
    return _stat(pid)[0]


def alive(pid: int) -> bool:
    return proc_state(pid) not in ("", "Z", "X")


def sigterm_pending(pid: int) -> bool:
    """Whether SIGTERM waits to be delivered to `pid` (it does while the process is stopped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("SigPnd", "ShdPnd") and int(value.strip() or "0", 16) & _SIGTERM_BIT:
            return True
    return False


@dataclass(frozen=True)
class Marked:
    pid: int
    rank: int | None  # RANK of a torchrun worker (and its children), None for any other process of the launch
    state: str
    ppid: int


def _environ(pid: str) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)


def find_marked(marker: dict[str, str]) -> list[Marked]:
    """The live processes whose environment carries `marker` (this process excluded)."""
    ((name, value),) = marker.items()
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        env = _environ(entry.name)
        if env is None or env.get(name) != value:
            continue
        state, ppid = _stat(int(entry.name))
        if state in ("", "Z", "X"):
            continue
        rank = env.get("RANK")
        found.append(Marked(int(entry.name), int(rank) if rank and rank.isdigit() else None, state, ppid))
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end_processes(pids: list[int], grace: float) -> None:
    """SIGTERM and SIGCONT to each, SIGKILL to those still there after `grace` seconds; returns once all are
    gone (or 5 s more passed: a zombie waits for its parent)."""
    for sig in (signal.SIGTERM, signal.SIGCONT):
        for pid in pids:
            _signal(pid, sig)
    deadline = time.time() + grace
    while time.time() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            _signal(pid, signal.SIGKILL)
    deadline = time.time() + 5
    while time.time() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)


def end_marked(marker: dict[str, str], grace: float) -> None:
    """End every process of the launch, including those started while the first ones were being ended."""
    for _ in range(3):
        pids = [p.pid for p in find_marked(marker)]
        if not pids:
            return
        end_processes(pids, grace)


class WorkerWatch:
    """While a launcher's agent runs its workers (its own children, marked): notes the first worker stopped
    (state T) for `after` seconds, continues (SIGCONT) any stopped process that a SIGTERM waits on so that the
    agent's shutdown reaches it at once rather than at its SIGKILL 30 s later, and on exit ends every process
    of the launch still there (children of workers in sessions of their own too)."""

    def __init__(self, marker: dict[str, str], *, after: float = 3.0, interval: float = 1.0, grace: float = 5.0):
        self.marker, self.after, self.interval, self.grace = marker, after, interval, grace
        self.first_stopped: Marked | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="neurontrain-worker-watch", daemon=True)

    def __enter__(self) -> WorkerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        end_marked(self.marker, grace=self.grace)

    def _follow(self) -> None:
        stopped_since: dict[int, float] = {}
        while not self._done.wait(self.interval):
            now = time.time()
            for proc in find_marked(self.marker):
                if proc.state != "T":
                    stopped_since.pop(proc.pid, None)
                elif sigterm_pending(proc.pid):
                    _signal(proc.pid, signal.SIGCONT)
                elif proc.rank is not None and proc.ppid == os.getpid() and self.first_stopped is None:
                    if now - stopped_since.setdefault(proc.pid, now) >= self.after:
                        self.first_stopped = proc
