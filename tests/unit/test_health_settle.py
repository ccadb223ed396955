"""How the health coordinator settles the workers still "running" when its watch ends (health/runner.py)."""

import os

from neurontrain.health.runner import _settle_states

GONE = 2**22 + 12345  # above the default pid_max: no such process


def _running(pid: int, check: str) -> dict:
    return {"pid": pid, "state": "running", "current": {"check": check}}


def test_a_rank_waiting_on_a_stalled_one_is_interrupted_not_hung():
    reports = {0: _running(os.getpid(), "rendezvous"), 1: _running(GONE, "start-up")}
    _settle_states(reports, {1: "hung"}, timed_out=True, local=range(2))
    assert reports[0]["state"] == "interrupted" and reports[1]["state"] == "hung"


def test_a_dead_rank_is_died_and_the_other_is_not_blamed():
    reports = {0: _running(os.getpid(), "all_reduce 1024B"), 1: _running(GONE, "all_reduce 1024B")}
    _settle_states(reports, {}, timed_out=True, local=range(2))
    assert (reports[0]["state"], reports[1]["state"]) == ("interrupted", "died")


def test_at_the_deadline_with_no_culprit_every_running_rank_hung():
    reports = {0: _running(os.getpid(), "all_reduce 1024B"), 1: _running(os.getpid(), "all_reduce 1024B")}
    _settle_states(reports, {}, timed_out=True, local=range(2))
    assert {r["state"] for r in reports.values()} == {"hung"}
    missing = {0: _running(os.getpid(), "rendezvous")}  # rank 1 never started: rank 0 only waited on it
    _settle_states(missing, {}, timed_out=True, local=range(2))
    assert missing[0]["state"] == "interrupted"
