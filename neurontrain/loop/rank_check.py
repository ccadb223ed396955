"""Ranks that would run different graphs, named before a collective hangs on them.

Every worker of a run follows one plan: at each step all of them run the same graph key (the global batch has one
length). A worker that does not (another bucket, another code path) runs another graph, and the next collective
waits for it until its timeout (on Neuron, forever), with no word of which rank or which shapes. So the workers
compare what they are about to run, through the job's key-value store (torchrun's TCPStore behind the process
group: bounded by a timeout, and apart from the training collectives), at two kinds of moment:

- the points where the plan introduces a graph (the first step of each train key from this run's start, the first
  batch of each eval length in the first evaluation): every worker reaches them, so every worker takes part, and
  each publishes its batch shapes before the step runs; a worker whose shapes differ from the plan's is named;
- a graph the recompilation guard did not expect, outside those points (whatever train.recompile_guard says):
  only the workers that saw it publish it, and wait a bounded window (twice that compile's seconds, at least
  `ALONE_WINDOW_S`) for the others to publish the same; a worker left alone is the one that diverged.

Between those moments nothing is exchanged: `counts()` (summary.json's `rank_checks`) shows the exchanges made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from neurontrain.errors import NeurontrainError

ALONE_WINDOW_S = 10.0  # at least this long for peers to report the same unexpected graph


class RankDivergence(NeurontrainError):
    """Workers of one run would run different graphs (exit 1)."""


def introduction_points(lengths: list[int], accum: int, split_step: bool, start_step: int) -> dict[int, list[int]]:
    """{step: its micro-batch lengths} for the train steps (numbered from 1, after `start_step`) at which the plan
    runs a graph key for the first time in this run (pure). lengths: every planned micro-batch's length, in order."""
    seen: set[tuple] = set()
    out: dict[int, list[int]] = {}
    for step in range(start_step + 1, len(lengths) // accum + 1):
        micro = lengths[(step - 1) * accum : step * accum]
        keys = {("train-micro", n) for n in micro} if split_step else {("train", micro[-1])}
        if keys - seen:
            out[step] = micro
        seen |= keys
    return out


def eval_points(lengths: list[int]) -> set[int]:
    """Indices of the eval batches whose length is new in evaluation order (pure)."""
    seen: set[int] = set()
    out = set()
    for i, n in enumerate(lengths):
        if n not in seen:
            out.add(i)
        seen.add(n)
    return out


def divergent(shapes: list[Any], planned: Any) -> list[int]:
    """Ranks whose shapes differ from the plan's; when none matches the plan, those that differ from the most common
    shapes (pure)."""
    off_plan = [r for r, s in enumerate(shapes) if s != planned]
    if len(off_plan) < len(shapes):
        return off_plan
    common = max(shapes, key=lambda s: sum(1 for t in shapes if t == s))
    return [r for r, s in enumerate(shapes) if s != common]


def describe(where: str, shapes: list[Any], ranks: list[int], planned: Any) -> str:
    """One line naming the diverging ranks and their shapes against the others' (pure)."""
    others = [r for r in range(len(shapes)) if r not in ranks]
    named = "; ".join(f"rank {r} has input_ids {shapes[r]}" for r in ranks)
    return (
        f"workers diverge at {where}: {named}, where the plan has {planned}"
        + (f" (as ranks {', '.join(map(str, others))})" if others else "")
        + ": they would run different graphs and the next collective would hang"
    )


def for_run(plan: Any, dp: Any, start_step: int) -> RankCheck:
    """The check of a run's workers (`plan`: a RunPlan; `dp`: this worker's DataParallel)."""
    recipe = plan.recipe
    lengths = plan.train_lengths_used  # every planned micro-batch's length, a stream's too
    return RankCheck(
        dp.store() if dp.enabled else None,
        dp.rank,
        dp.world,
        introduction_points(lengths, recipe.train.grad_accum, plan.split_step, start_step),
        eval_points([b.length for b in plan.eval_batches]),
        recipe.data.batch_size,
        recipe.data.eval_batch_size or recipe.data.batch_size,
        recipe.runtime.collective_timeout,
    )


@dataclass
class RankCheck:
    """The workers' comparisons of what they run, through `store` (None: a run of one worker checks nothing)."""

    store: Any
    rank: int
    world: int
    train_points: dict[int, list[int]]
    eval_at: set[int]
    batch: int
    eval_batch: int
    timeout_s: float
    alone_window_s: float = ALONE_WINDOW_S
    exchanges: list[str] = field(default_factory=list)
    _evaluated: bool = False

    def before_train(self, step: int, shapes: list[list[int]]) -> None:
        """At a step where the plan introduces a train graph: compare the micro-batches' input_ids shapes."""
        if self.store is None or step not in self.train_points:
            return
        planned = [[self.batch, n] for n in self.train_points[step]]
        if len(planned) == 1:  # one micro-batch a step: its shape alone
            planned, shapes = planned[0], shapes[0]
        self._compare(f"step {step} (train)", planned, shapes)

    def before_eval(self, index: int, shape: list[int], length: int) -> None:
        """In the first evaluation, at each eval batch whose length is new: compare its shape."""
        if self.store is None or self._evaluated or index not in self.eval_at:
            return
        self._compare(f"eval batch {index} (first evaluation)", [self.eval_batch, length], shape)

    def eval_done(self) -> None:
        self._evaluated = True

    def after_unexpected(self, event: dict | None, seconds: float) -> None:
        """This worker compiled a graph the plan did not expect: wait a bounded window for every other worker to
        report the same one; a worker left alone diverged."""
        if self.store is None or event is None:
            return
        tag = f"unexpected/{event['step']}/{'-'.join(map(str, event['key']))}"
        window = max(self.alone_window_s, 2.0 * seconds)
        self.exchanges.append(tag)
        self.store.set(f"rank-check/{tag}/{self.rank}", json.dumps(event.get("shapes", {})))
        missing = self._wait(tag, window)
        if missing:
            raise RankDivergence(
                f"worker rank {self.rank} alone compiled a graph the plan does not have at step {event['step']} "
                f"({event['kind']}, shapes {event.get('shapes', {})}: {event.get('reason')}); ranks "
                f"{', '.join(map(str, missing))} did not within {window:.0f} s: they would run other graphs and the "
                "next collective would hang"
            )

    def counts(self) -> dict:
        return {"exchanges": len(self.exchanges), "at": list(self.exchanges)}

    def _compare(self, where: str, planned: Any, mine: Any) -> None:
        tag = where.split(" (")[0].replace(" ", "-")
        self.exchanges.append(tag)
        self.store.set(f"rank-check/{tag}/{self.rank}", json.dumps(mine))
        missing = self._wait(tag, self.timeout_s)
        if missing:
            raise RankDivergence(
                f"workers diverge at {where}: ranks {', '.join(map(str, missing))} did not reach it within "
                f"{self.timeout_s:.0f} s"
            )
        shapes = [json.loads(self.store.get(f"rank-check/{tag}/{r}")) for r in range(self.world)]
        ranks = divergent(shapes, planned)
        if ranks:
            raise RankDivergence(describe(where, shapes, ranks, planned))

    def _wait(self, tag: str, seconds: float) -> list[int]:
        """Ranks whose key is still missing after `seconds`."""
        keys = [f"rank-check/{tag}/{r}" for r in range(self.world)]
        try:
            self.store.wait(keys, timedelta(seconds=seconds))
            return []
        except Exception:  # noqa: BLE001  # torch raises DistStoreError or RuntimeError on a timeout, by version
            return [r for r, k in enumerate(keys) if not self.store.check([k])]
