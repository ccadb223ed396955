"""Which samples go into which batch, at which padded length: a deterministic, resumable batch order.

Pure logic: no torch. The batches of epoch e depend only on (lengths, settings, seed, e), so a run resumed at
batch position p sees exactly the batches an uninterrupted run would have seen. With several workers every
batch here is a global one; each worker collates its own rows of it (`data/sharding.py`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from neurontrain.data.buckets import bucket_of_each, round_up
from neurontrain.data.packing import Packing, pack_rows
from neurontrain.errors import UsageError


@dataclass(frozen=True)
class IndexBatch:
    """One batch before collation: the samples' indices and the length they are padded to. Packed batches
    also have rows: the samples of each row, in the row's order (indices is them all, row after row)."""

    length: int
    indices: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...] | None = None

    @property
    def units(self) -> tuple:
        """What a batch has batch_size of and what data-parallel workers split: samples, or packed rows."""
        return self.rows if self.rows is not None else self.indices


def _packed_batch(length: int, rows: tuple[tuple[int, ...], ...]) -> IndexBatch:
    return IndexBatch(length, tuple(i for row in rows for i in row), rows)


@dataclass(frozen=True)
class Batcher:
    lengths: tuple[int, ...]
    batch_size: int
    buckets: tuple[int, ...] | None  # None: dynamic padding to the longest sample of each batch
    shuffle: bool
    seed: int
    drop_last: bool
    multiple: int = 1
    packing: Packing | None = None  # set: batches of batch_size packed rows of packing.row_length
    # the last epochs made: planning walks the first epoch several times (a million samples pack in seconds)
    _recent: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __getstate__(self) -> dict:  # a batcher sent to another process goes without its epochs
        return {k: v for k, v in self.__dict__.items() if k != "_recent"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _recent={})

    def _chunks(self, indices: list) -> list[tuple]:
        out = [tuple(indices[i : i + self.batch_size]) for i in range(0, len(indices), self.batch_size)]
        if out and self.drop_last and len(out[-1]) < self.batch_size:
            out.pop()
        return out

    def epoch(self, epoch: int) -> list[IndexBatch]:
        if epoch not in self._recent:
            if len(self._recent) >= 2:
                del self._recent[min(self._recent)]
            self._recent[epoch] = self._make_epoch(epoch)
        return self._recent[epoch]

    def _make_epoch(self, epoch: int) -> list[IndexBatch]:
        rng = random.Random(f"{self.seed}:{epoch}")
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)
        batches: list[IndexBatch] = []
        if self.packing is not None:
            rows = pack_rows(self.lengths, order, self.packing)
            if self.shuffle:
                rng.shuffle(rows)
            return [_packed_batch(self.packing.row_length, chunk) for chunk in self._chunks(rows)]
        if self.buckets is None:
            for chunk in self._chunks(order):
                longest = max(self.lengths[i] for i in chunk)
                batches.append(IndexBatch(round_up(longest, self.multiple), chunk))
        else:
            for length, members in _grouped_by_bucket(self.lengths, order, self.buckets):
                batches.extend(IndexBatch(length, chunk) for chunk in self._chunks(members))
            if self.shuffle:
                rng.shuffle(batches)
        return batches

    def batches_per_epoch(self) -> int:
        return len(self.epoch(0))

    def iterate(self, start: int = 0) -> Iterator[IndexBatch]:
        """Endless stream of batches from position `start` (counted in batches since the first epoch)."""
        if self.batches_per_epoch() == 0:
            raise ValueError("the data yields no batch (fewer samples than one batch with last_batch: drop)")
        position, epoch = 0, 0
        while True:
            for batch in self.epoch(epoch):
                if position >= start:
                    yield batch
                position += 1
            epoch += 1

    def used_lengths(self, n_batches: int, start: int = 0) -> list[int]:
        """Padded lengths of the next n_batches batches, in order (graph discovery by construction)."""
        out = []
        for batch in self.iterate(start):
            if len(out) == n_batches:
                break
            out.append(batch.length)
        return out


def _grouped_by_bucket(lengths: Sequence[int], order: list[int], buckets: Sequence[int]) -> list[tuple[int, list[int]]]:
    """(bucket, the samples of `order` in it, in that order) for each used bucket, shortest first."""
    ordered = np.asarray(order, dtype=np.int64)
    each = bucket_of_each(np.asarray(lengths, dtype=np.int64)[ordered], buckets) if len(order) else ordered
    grouped = ordered[np.argsort(each, kind="stable")]
    used, starts = np.unique(each[np.argsort(each, kind="stable")], return_index=True)
    ends = [*starts[1:].tolist(), len(order)]
    return [(int(b), grouped[s:e].tolist()) for b, s, e in zip(used, starts.tolist(), ends, strict=True)]


def fixed_batches(
    lengths: Sequence[int],
    batch_size: int,
    buckets: Sequence[int] | None,
    multiple: int = 1,
    packing: Packing | None = None,
) -> list[IndexBatch]:
    """Evaluation batches: every sample exactly once, in order, grouped by bucket (or packed into rows of
    batch_size a batch); partial batches kept."""
    batcher = Batcher(
        tuple(lengths), batch_size, tuple(buckets) if buckets else None, False, 0, False, multiple, packing
    )
    return batcher.epoch(0)


def check_targets(lengths: Sequence[int], batches: Iterable[IndexBatch], count: int, split: str) -> None:
    """UsageError for the first of `count` causal-LM batches with nothing to predict: every sample in it one token
    long (a token is predicted from the ones before it), so its loss would be 0/0, NaN from that step on."""
    for position, batch in enumerate(itertools.islice(batches, count)):
        if all(lengths[i] < 2 for i in batch.indices):
            short = sum(1 for n in lengths if n < 2)
            raise UsageError(
                f"{split} batch {position} has nothing to predict: its {len(batch.indices)} samples are one token "
                f"long or empty ({short} of the {len(lengths)} {split} samples are); check the tokenizer and "
                "data.text_field"
            )
