"""What a Lightning precompile fit visits and how its graphs are named: pure logic, no Lightning, no torch-xla.

The fit trains `len(buckets)` optimizer steps: step i pads (or cuts) every micro-batch of its window to bucket
i, so each bucket is visited as the first micro-batch of a window and, with accumulation, as the others; every
evaluation batch takes the next bucket in turn, so a validation run (after the sanity check's batches) visits
each eval bucket. The graphs the fit cut come from torch-xla's own dump; the fit's syncs are windows of the dump
file, so a graph is named by the sync that cut it (`train 32`), or `other` with its caller when it was cut
elsewhere (a preflight check, Lightning's own host read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neurontrain.compile.graphs import graph_id
from neurontrain.compile.xla_dump import DumpedGraph


@dataclass
class Visits:
    """The bucket each batch of the precompile fit is brought to."""

    buckets: list[int]
    accumulate: int = 1
    train_seen: int = 0
    eval_seen: int = 0

    @property
    def steps(self) -> int:
        return len(self.buckets)

    def train_target(self) -> int:
        target = self.buckets[(self.train_seen // max(1, self.accumulate)) % len(self.buckets)]
        self.train_seen += 1
        return target

    def eval_target(self) -> int:
        target = self.buckets[self.eval_seen % len(self.buckets)]
        self.eval_seen += 1
        return target


@dataclass
class Window:
    """A stretch [start, end) of the dump file: one of the fit's syncs (key set) or what ran between two
    (key None); the runtime modules extracted during it; the batch shapes of the sync."""

    start: int
    end: int | None
    key: tuple | None = None
    modules: list[str] = field(default_factory=list)
    shapes: dict = field(default_factory=dict)
    seconds: float = 0.0

    def holds(self, offset: int) -> bool:
        return self.start <= offset and (self.end is None or offset < self.end)


@dataclass(frozen=True)
class FitGraph:
    key: tuple
    graph_id: str
    hlo: str
    modules: tuple[str, ...]
    shapes: dict
    seconds: float


def fit_graphs(blocks: list[DumpedGraph], windows: list[Window]) -> list[FitGraph]:
    """Each distinct graph of the dump once (by graph id, in the order first cut), named by its window. A
    window's extracted modules go with every new graph of that window (a sync usually cuts one)."""
    seen: set[str] = set()
    out: list[FitGraph] = []
    for window in windows:
        new = []
        for block in blocks:
            if not window.holds(block.offset):
                continue
            gid = graph_id(block.hlo)
            if gid not in seen:
                seen.add(gid)
                new.append((gid, block))
        for gid, block in new:
            key = window.key if window.key is not None else ("other", block.caller())
            out.append(FitGraph(key, gid, block.hlo, tuple(window.modules), window.shapes, window.seconds))
    return out
