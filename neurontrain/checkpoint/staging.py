"""A destination built in a hidden sibling directory and renamed into place when complete, and the clean-up
of what a migrate that did not finish (SIGKILL, power loss) left beside it.

A migrate to DST works with three siblings of DST that share one random token:

- `.DST.lock-<token>`: a lock file, locked with an exclusive `flock` before it gets this name and held
  for as long as the migrate runs; it holds the owner's pid and host, for messages only. The kernel
  releases the lock when the process ends, however it ends, so "the lock can be taken" means "its owner
  is dead" whatever has become of the pid since (a reused pid does not keep a stale directory alive).
- `.DST.partial-<token>`: the directory being built; renamed to DST at the end.
- `.DST.old-<token>`: with overwrite, the previous DST, moved aside between the two renames and deleted
  after them.

Before it creates its own, a migrate looks at the siblings of every other token. A lock that is held means
another migrate is writing DST: refused (UsageError). A lock that can be taken belongs to a migrate that
did not finish: its partial directory is removed, and its old directory is removed when DST exists or
renamed back to DST when it does not (the migrate stopped between its two renames: the old directory is
the user's only copy). Each of these is logged. The lock file is removed last, and only while held, so
two migrates cleaning up at once do not both act; a migrate that fails keeps its lock file only while a
directory of its own is left (a clean-up that failed), for the next one to remove.

A partial or old directory without a lock file was left by a migrate of a neurontrain from before these
lock files (or its lock file was deleted). Its owner cannot be known, and no age tells a dead migrate from
a slow one (a 70B model takes far longer than minutes), so it is left alone with a warning naming it;
an old directory whose DST is missing is named as the previous DST, to be renamed back by hand.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from neurontrain.errors import UsageError
from neurontrain.fileio import fsync_path
from neurontrain.logs import get_logger

log = get_logger(__name__)
__all__ = ["group_leftovers", "recover_leftovers", "stale_steps", "staged_destination"]

KINDS = ("partial", "old")  # the directories a migrate's lock file vouches for


def sibling(dest: Path, kind: str, token: str) -> Path:
    """The hidden sibling of `dest` of `kind` (partial, old, lock) for the migrate of `token`."""
    return dest.parent / f".{dest.name}.{kind}-{token}"


def group_leftovers(entry_names: Iterable[str], dest_name: str) -> dict[str, set[str]]:
    """The siblings of a destination named `dest_name` among `entry_names`, as {token: {kinds present}}."""
    pattern = re.compile(rf"\.{re.escape(dest_name)}\.(partial|old|lock)-([0-9a-f]+)")
    groups: dict[str, set[str]] = {}
    for name in entry_names:
        match = pattern.fullmatch(name)
        if match:
            groups.setdefault(match.group(2), set()).add(match.group(1))
    return groups


def stale_steps(kinds: Iterable[str], dest_exists: bool) -> list[tuple[str, str]]:
    """What to do, as (action, kind) in order, with the directories of a migrate whose owner is dead: its old
    directory goes back to the destination when that is missing, everything else is removed."""
    steps = []
    if "old" in kinds:
        steps.append(("remove" if dest_exists else "restore", "old"))
    if "partial" in kinds:
        steps.append(("remove", "partial"))
    return steps


def describe_owner(lock_text: str) -> str:
    """'pid N on HOST' from a lock file's content ('pid unknown' before the owner wrote it)."""
    try:
        owner = json.loads(lock_text)
        return f"pid {int(owner['pid'])} on {owner['host']}"
    except (ValueError, TypeError, KeyError):
        return "pid unknown"


def _read_owner(fd: int) -> str:
    return describe_owner(os.pread(fd, 4096, 0).decode(errors="replace"))


def _claim(fd: int) -> None:
    """Write this process as the holder of the lock on `fd` (for the messages of other migrates)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)


def _still_linked(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def recover_leftovers(dest: Path) -> None:
    """Clean up after every migrate to `dest` that did not finish; refuse when another one is running."""
    for token, kinds in sorted(group_leftovers(os.listdir(dest.parent), dest.name).items()):
        if "lock" in kinds:
            _recover_locked(dest, token)
        else:
            _warn_unlocked(dest, token, kinds)


def _recover_locked(dest: Path, token: str) -> None:
    lock_path = sibling(dest, "lock", token)
    try:
        fd = os.open(lock_path, os.O_RDWR)  # read-write: flock over NFS needs it for an exclusive lock
    except FileNotFoundError:
        return  # its migrate finished, or another one cleaned up, since the listing
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"another migrate ({_read_owner(fd)}) is writing {dest}") from None
        if not _still_linked(fd, lock_path):
            return  # released and removed by its owner or by another migrate since we opened it
        owner = _read_owner(fd)
        _claim(fd)
        present = [kind for kind in KINDS if sibling(dest, kind, token).exists()]
        for action, kind in stale_steps(present, dest.exists()):
            _apply(action, kind, sibling(dest, kind, token), dest, owner)
        lock_path.unlink()
    finally:
        os.close(fd)


REMOVED = {
    "partial": "removed a partial destination left by a migrate that did not finish (%s): %s",
    "old": "removed the previous destination, replaced by a migrate that did not finish (%s): %s",
}


def _apply(action: str, kind: str, path: Path, dest: Path, owner: str) -> None:
    if action == "restore":
        os.rename(path, dest)
        log.warning(
            "restored %s from %s: a migrate --overwrite (%s) stopped after moving it aside and before "
            "putting its output in place",
            dest,
            path,
            owner,
        )
    else:
        shutil.rmtree(path)
        log.info(REMOVED[kind], owner, path)


def _warn_unlocked(dest: Path, token: str, kinds: set[str]) -> None:
    for kind in KINDS:
        path = sibling(dest, kind, token)
        if kind not in kinds or not path.exists():
            continue
        if kind == "old" and not dest.exists():
            log.warning(
                "%s holds the previous %s (a migrate --overwrite stopped between its two renames); "
                "left alone: rename it to %s to restore it",
                path,
                dest.name,
                dest,
            )
        else:
            log.warning(
                "%s has no lock file: left by a migrate of an older neurontrain, or being written by one; "
                "left alone (remove it when no migrate is running)",
                path,
            )


@contextmanager
def _lock_of_new_migrate(dest: Path) -> Iterator[str]:
    """Create and hold the lock file of a new migrate to `dest`; yields the token its siblings share."""
    token = uuid.uuid4().hex[:16]
    lock_path = sibling(dest, "lock", token)
    # made under another name and renamed once locked: a migrate looking for leftovers never sees it unlocked
    unlocked = lock_path.with_name(lock_path.name + ".new")
    fd = os.open(unlocked, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
        _claim(fd)
        os.rename(unlocked, lock_path)
        yield token
    finally:
        # kept while a directory of ours is left (a failed clean-up): the next migrate then removes it
        if not any(sibling(dest, kind, token).exists() for kind in KINDS):
            lock_path.unlink(missing_ok=True)  # while still held, so a migrate that opened it sees it gone
        unlocked.unlink(missing_ok=True)
        os.close(fd)


def flush_to_disk(tree: Path) -> None:
    """fsync every file and directory under `tree`: a destination renamed into place is then complete on disk,
    even after a power loss right after the rename."""
    for root, _, files in os.walk(tree):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def _put_in_place(staging: Path, dest: Path, old: Path) -> None:
    flush_to_disk(staging)
    if not dest.exists():
        os.rename(staging, dest)
        fsync_path(str(dest.parent))
        return
    os.rename(dest, old)
    try:
        os.rename(staging, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    fsync_path(str(dest.parent))
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_destination(dest: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary sibling directory that becomes `dest` only when the body completes (removed when it
    raises); an existing `dest` is refused without `overwrite`. What migrates that did not finish left
    beside `dest` is cleaned up first (see the module docstring)."""
    if dest.parent.is_dir():
        recover_leftovers(dest)
    if dest.exists() and not overwrite:
        raise UsageError(f"{dest} exists (use --overwrite to replace it)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _lock_of_new_migrate(dest) as token:
        staging = sibling(dest, "partial", token)
        staging.mkdir()
        try:
            yield staging
            _put_in_place(staging, dest, sibling(dest, "old", token))
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
