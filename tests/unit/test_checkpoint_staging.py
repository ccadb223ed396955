"""The staged destination of `checkpoint migrate` and the clean-up after a migrate that did not finish.

A dead owner is what a killed migrate leaves: a lock file nobody holds (the kernel releases a flock when
its process ends). A live owner is a second open file description of the lock file, flocked from this
process: flock locks belong to open file descriptions, so the code under test's own open() conflicts with
it. The real SIGKILL is in tests/integration/test_migrate_crash.py."""

import fcntl
import json
import os
import socket

import pytest

from neurontrain.checkpoint.staging import (
    describe_owner,
    group_leftovers,
    recover_leftovers,
    sibling,
    staged_destination,
    stale_steps,
)
from neurontrain.errors import UsageError

DEAD_PID = 4_000_000  # above any pid_max: no process has it


def leftover(dest, token, kinds, pid=DEAD_PID, host="node-7"):
    """The siblings a migrate of `token` to `dest` leaves when it is killed: its lock file (unheld) and
    directories of `kinds`, each with a file inside."""
    sibling(dest, "lock", token).write_text(json.dumps({"pid": pid, "host": host}))
    for kind in kinds:
        sibling(dest, kind, token).mkdir()
        (sibling(dest, kind, token) / "weights.pt").write_text(kind)


def hidden(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_group_leftovers_takes_only_the_siblings_of_that_destination():
    names = [
        ".nxd.partial-0a1b",
        ".nxd.lock-0a1b",
        ".nxd.old-ff00",
        ".nxd.partial-xyz",  # not a token
        ".nxd2.partial-0a1b",  # another destination
        ".nxd.partial-0a1b.tmp",
        ".nxd.lock-0a1b.new",  # a lock file before it is locked and renamed
        "nxd",
        ".a.b.partial-12",
    ]
    assert group_leftovers(names, "nxd") == {"0a1b": {"partial", "lock"}, "ff00": {"old"}}
    assert group_leftovers(names, "a.b") == {"12": {"partial"}}
    assert group_leftovers([".a.b.partial-12"], "a") == {}  # "b.partial-12" is no token


def test_stale_steps_restore_the_old_destination_only_when_it_is_missing():
    assert stale_steps({"partial"}, dest_exists=False) == [("remove", "partial")]
    assert stale_steps({"old", "partial"}, dest_exists=False) == [("restore", "old"), ("remove", "partial")]
    assert stale_steps({"old", "partial"}, dest_exists=True) == [("remove", "old"), ("remove", "partial")]
    assert stale_steps(set(), dest_exists=True) == []


def test_describe_owner():
    assert describe_owner('{"pid": 12, "host": "node-1"}') == "pid 12 on node-1"
    assert describe_owner("") == "pid unknown"  # the owner was killed before writing it
    assert describe_owner('{"pid": 12}') == "pid unknown"


def test_stale_partial_is_removed_and_said(tmp_path, capsys):
    dest = tmp_path / "nxd"
    # the pid of a live process (this one): ownership is the lock, not the pid, so a reused pid changes nothing
    leftover(dest, "00aa", ["partial"], pid=os.getpid())
    with staged_destination(dest, overwrite=False) as out:
        (out / "done").touch()
    assert (dest / "done").is_file() and hidden(tmp_path) == []
    err = capsys.readouterr().err
    assert (
        "removed a partial destination left by a migrate that did not finish "
        f"(pid {os.getpid()} on node-7): {sibling(dest, 'partial', '00aa')}"
    ) in err


def test_live_owner_is_refused_and_its_directory_kept(tmp_path):
    dest = tmp_path / "nxd"
    leftover(dest, "00aa", ["partial"], pid=123)
    with open(sibling(dest, "lock", "00aa"), "r+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UsageError, match=rf"^another migrate \(pid 123 on node-7\) is writing {dest}$"):
            with staged_destination(dest, overwrite=True):
                pytest.fail("the body ran")
    assert hidden(tmp_path) == [".nxd.lock-00aa", ".nxd.partial-00aa"]
    assert (sibling(dest, "partial", "00aa") / "weights.pt").read_text() == "partial"


def test_stale_old_is_restored_when_the_destination_is_missing(tmp_path, capsys):
    """Killed between its two renames: the old directory is the only copy of the destination."""
    dest = tmp_path / "nxd"
    leftover(dest, "00aa", ["old", "partial"])
    with pytest.raises(UsageError, match="exists"):  # restored first, so refused without --overwrite
        with staged_destination(dest, overwrite=False):
            pytest.fail("the body ran")
    assert (dest / "weights.pt").read_text() == "old" and hidden(tmp_path) == []
    err = capsys.readouterr().err
    assert f"restored {dest} from {sibling(dest, 'old', '00aa')}" in err and f"pid {DEAD_PID} on node-7" in err


def test_stale_old_is_removed_when_the_destination_exists(tmp_path, capsys):
    """Killed after putting its output in place, while deleting the previous destination."""
    dest = tmp_path / "nxd"
    dest.mkdir()
    (dest / "weights.pt").write_text("new")
    leftover(dest, "00aa", ["old"])
    recover_leftovers(dest)
    assert (dest / "weights.pt").read_text() == "new" and hidden(tmp_path) == []
    assert f"removed the previous destination, replaced by a migrate that did not finish (pid {DEAD_PID}" in (
        capsys.readouterr().err
    )


def test_unlocked_directories_of_older_migrates_are_left_alone_with_a_warning(tmp_path, capsys):
    dest = tmp_path / "nxd"
    for kind in ("partial", "old"):
        sibling(dest, kind, "1234abcd").mkdir()
    with staged_destination(dest, overwrite=False) as out:
        (out / "done").touch()
    assert hidden(tmp_path) == [".nxd.old-1234abcd", ".nxd.partial-1234abcd"]
    err = capsys.readouterr().err
    assert f"{sibling(dest, 'partial', '1234abcd')} has no lock file" in err
    assert f"{sibling(dest, 'old', '1234abcd')} holds the previous nxd" in err


def test_the_lock_is_held_while_the_body_runs_and_nothing_is_left_after(tmp_path):
    dest = tmp_path / "nxd"
    with staged_destination(dest, overwrite=False) as out:
        (lock,) = tmp_path.glob(".nxd.lock-*")
        assert lock.name.split("-")[-1] == out.name.split("-")[-1]
        assert describe_owner(lock.read_text()) == f"pid {os.getpid()} on {socket.gethostname()}"
        with open(lock, "r+") as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UsageError, match=rf"another migrate \(pid {os.getpid()} on .*\) is writing"):
            recover_leftovers(dest)
        (out / "v").write_text("1")
    with staged_destination(dest, overwrite=True) as out:
        (out / "v").write_text("2")
    assert (dest / "v").read_text() == "2" and hidden(tmp_path) == []


def test_a_failed_body_leaves_nothing(tmp_path):
    dest = tmp_path / "nxd"
    with pytest.raises(RuntimeError):
        with staged_destination(dest, overwrite=False) as out:
            (out / "half").touch()
            raise RuntimeError("bad input")
    assert list(tmp_path.iterdir()) == []
