"""The data service's pure parts: batches by position, the lockstep check, sizing (no torch: `submit` reads the
label from here). Rows in and out are `data/rows.py`.

A service stream is one training worker's micro-batches, in plan order from a data position: row p holds the
worker's rows of the plan's global batch p, its padded length and the node that made it. Every worker's stream
is cut from the same plan, so all workers train the same bucket at every step, and a stream restarted at a
checkpoint's position is the one an uninterrupted run would have read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from neurontrain.data.batching import Batcher, IndexBatch

LABEL_KEY = "neurontrain-role"  # the node label a Ray node's role is read from


class BatchIndex:
    """Random access to a batcher's endless batch order, one epoch's batches at a time."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self.per_epoch = batcher.batches_per_epoch()
        if self.per_epoch == 0:
            raise ValueError("the data yields no batch (fewer samples than one batch with last_batch: drop)")
        self._epoch: tuple[int, list[IndexBatch]] | None = None

    def at(self, position: int) -> IndexBatch:
        epoch, offset = divmod(position, self.per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, self.batcher.epoch(epoch))
        return self._epoch[1][offset]


@dataclass(frozen=True)
class Collation:
    """What a collation actor needs besides the ids: the plan's batch order and one worker's collator."""

    batcher: Batcher
    task: str
    batch_size: int
    pad_id: int
    rank: int
    world: int
    max_docs: int | None


class LockstepError(RuntimeError):
    """A worker's stream left the plan: another position or another bucket than planned."""


@dataclass
class StreamRecord:
    """What one worker's stream delivered: (position, padded length) in order, and batches per producing node."""

    rank: int
    received: list[tuple[int, int]] = field(default_factory=list)
    produced_on: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"rank": self.rank, "received": self.received, "produced_on": self.produced_on}


def in_lockstep(
    rows: Iterable[tuple[int, str, dict]], planned: Iterator[IndexBatch], start: int, record: StreamRecord
) -> Iterator[dict]:
    """The stream's micro-batches, each checked against the plan's batch at its position (from `start`)."""
    for expected, (position, node, batch) in enumerate(rows, start=start):
        length = batch["input_ids"].shape[1]
        planned_length = next(planned).length
        if position != expected or length != planned_length:
            raise LockstepError(
                f"data service: worker {record.rank} received batch {position} of length {length}; the plan has "
                f"batch {expected} of length {planned_length}"
            )
        record.received.append((position, length))
        record.produced_on[node] = record.produced_on.get(node, 0) + 1
        yield batch


def data_cpus_needed(world: int, concurrency: int) -> int:
    """CPUs the data nodes need at once: per worker's stream, its collation actors and one read task."""
    return world * (concurrency + 1)


def local_cluster_sizes(spec: str) -> dict[str, int]:
    """`--local-cluster data=1,trainium=1` -> {"data": 1, "trainium": 1} (both roles, at least one node)."""
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        role, sep, count = part.strip().partition("=")
        if not sep or role not in ("data", "trainium") or not count.isdigit() or int(count) < 1 or role in sizes:
            raise ValueError(f"--local-cluster {spec!r}: expected data=N,trainium=M with N, M >= 1")
        sizes[role] = int(count)
    if set(sizes) != {"data", "trainium"}:
        raise ValueError(f"--local-cluster {spec!r}: name both roles, data=N,trainium=M")
    return sizes
