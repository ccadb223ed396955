"""Rank divergence (loop/rank_check.py): where the plan introduces a graph, which ranks diverge, and the exchanges
through a real torch.distributed store (one HashStore shared by two threads standing for two workers)."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from neurontrain.compile.trace_group import distinct_ranks
from neurontrain.loop.rank_check import RankCheck, RankDivergence, divergent, eval_points, introduction_points


def test_introduction_points_are_the_first_steps_of_each_key_from_the_start_step():
    lengths = [64, 64, 128, 64, 256, 128]
    assert introduction_points(lengths, 1, False, 0) == {1: [64], 3: [128], 5: [256]}
    assert introduction_points(lengths, 1, False, 3) == {4: [64], 5: [256], 6: [128]}  # a resumed run compiles anew
    # accumulation: a step's key is its last micro-batch's length; split steps: every micro-batch's
    assert introduction_points(lengths, 2, False, 0) == {1: [64, 64], 3: [256, 128]}
    assert introduction_points(lengths, 2, True, 0) == {1: [64, 64], 2: [128, 64], 3: [256, 128]}
    assert introduction_points([64, 128, 64, 64], 2, True, 0) == {1: [64, 128]}
    assert eval_points([128, 64, 128, 64, 32]) == {0, 1, 4}


def test_the_rank_off_the_plan_is_named_and_a_majority_decides_when_none_follows_it():
    assert divergent([[8, 128], [8, 64], [8, 128]], [8, 128]) == [1]
    assert divergent([[8, 128], [8, 128]], [8, 128]) == []
    assert divergent([[8, 32], [8, 32], [8, 16]], [8, 128]) == [2]


def test_ranks_with_the_same_shapes_share_one_compile():
    same = {0: [{"input_ids": [8, 128]}], 1: [{"input_ids": [8, 128]}], 2: [{"input_ids": [8, 64]}]}
    assert distinct_ranks(same) == {0: [0, 1], 2: [2]}


def _checks(world: int = 2, **kw) -> list[RankCheck]:
    store = dist.HashStore()
    return [RankCheck(store, r, world, {1: [128], 3: [64]}, {0}, 8, 8, 5.0, **kw) for r in range(world)]


def _in_threads(*calls) -> list:
    errors: list = [None] * len(calls)

    def run(i, call):
        try:
            call()
        except Exception as exc:  # noqa: BLE001  # handed to the test
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_a_rank_with_other_shapes_at_a_planned_graph_is_named_by_every_rank():
    zero, one = _checks()
    errors = _in_threads(lambda: zero.before_train(1, [[8, 128]]), lambda: one.before_train(1, [[8, 64]]))
    assert all(isinstance(e, RankDivergence) for e in errors), errors
    assert "rank 1 has input_ids [8, 64], where the plan has [8, 128] (as ranks 0)" in str(errors[0])
    assert str(errors[0]) == str(errors[1])


def test_steady_state_steps_exchange_nothing():
    zero, one = _checks()
    errors = _in_threads(*[lambda c=c: [c.before_train(s, [[8, 128 if s < 3 else 64]]) for s in (1, 2, 3, 4)]
                           for c in (zero, one)])  # fmt: skip
    assert errors == [None, None]
    assert zero.counts() == {"exchanges": 2, "at": ["step-1", "step-3"]}  # steps 2 and 4 exchanged nothing


def test_a_rank_alone_with_an_unexpected_graph_is_named_after_its_window_and_peers_that_saw_it_too_are_not():
    zero, one = _checks(alone_window_s=0.5)
    event = {"step": 7, "kind": "train", "key": ["train", 96], "shapes": {"input_ids": [8, 96]}, "reason": "x"}
    start = time.perf_counter()
    with pytest.raises(RankDivergence, match=r"worker rank 1 alone compiled .* step 7 .*ranks 0 did not within 0 s"):
        one.after_unexpected(event, 0.1)
    assert time.perf_counter() - start < 5
    zero, one = _checks(alone_window_s=0.5)
    assert _in_threads(lambda: zero.after_unexpected(event, 0.1), lambda: one.after_unexpected(event, 0.1)) == [
        None,
        None,
    ]


def test_a_run_of_one_worker_checks_nothing():
    check = RankCheck(None, 0, 1, {1: [128]}, {0}, 8, 8, 5.0)
    check.before_train(1, [[8, 64]])
    check.after_unexpected({"step": 1, "kind": "train", "key": ["train", 64]}, 1.0)
    assert check.counts()["exchanges"] == 0
