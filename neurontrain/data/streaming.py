"""Streaming (`data.streaming`): documents read shard by shard, packed on the fly into rows of one length.

Pure logic: no torch, no I/O (the shards are read by `data/stream_source.py`). Documents are placed in the
stream's order, one after the other, each as a document of its own in the row (per-document attention); one
that does not fit the rest of a row continues at the start of the next one, so every row is full and no token
is dropped. What follows a row depends only on where the row ended (`StreamPosition`): a run restarted there
packs exactly the rows an uninterrupted run packed next, without reading the stream before it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass

from neurontrain.data.batching import IndexBatch

POSITION_KEY = "stream_position"  # a collated batch's key: the stream position after it (a host value)


@dataclass(frozen=True)
class StreamPosition:
    """Where the stream continues: in `epoch`, the `shard`-th shard of that epoch's order, at its line `record`
    (which starts at `byte`), of which `offset` tokens are already in rows."""

    epoch: int = 0
    shard: int = 0
    record: int = 0
    byte: int = 0
    offset: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: dict) -> StreamPosition:
        fields = ("epoch", "shard", "record", "byte", "offset")
        if not isinstance(value, dict) or set(value) != set(fields) or any(type(value[f]) is not int for f in fields):
            raise ValueError(f"not a stream position: {value!r}")
        if any(value[f] < 0 for f in fields):
            raise ValueError(f"a stream position counts from 0: {value!r}")
        return cls(**value)


@dataclass(frozen=True)
class Document:
    """One record's token ids, where it starts (`at`: offset 0) and where the record after it starts."""

    at: StreamPosition
    next_byte: int
    ids: Sequence[int]


@dataclass(frozen=True)
class Row:
    """A full row: its pieces of documents in order, and the stream position after it."""

    pieces: tuple[Sequence[int], ...]
    after: StreamPosition


def shard_order(count: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The shards' order in `epoch` (indices into the sorted shard list): shuffled per epoch under data.seed."""
    order = list(range(count))
    if shuffle:
        random.Random(f"stream:{seed}:{epoch}").shuffle(order)
    return order


def pack_rows(documents: Iterable[Document], row_length: int, partial_last: bool = False) -> Iterator[Row]:
    """Rows of `row_length` tokens from the documents in order; the first document is taken from its position's
    offset. A document cut at a row's end continues the next row, as a document of its own there. partial_last:
    the documents end (an eval set): the last, unfilled row too."""
    if row_length < 1:
        raise ValueError(f"rows need a positive length, not {row_length}")
    pieces: list[Sequence[int]] = []
    used = 0
    after = None
    for doc in documents:
        start = doc.at.offset
        while start < len(doc.ids):
            piece = doc.ids[start : start + row_length - used]
            pieces.append(piece)
            used += len(piece)
            start += len(piece)
            if start < len(doc.ids):
                after = StreamPosition(doc.at.epoch, doc.at.shard, doc.at.record, doc.at.byte, start)
            else:
                after = StreamPosition(doc.at.epoch, doc.at.shard, doc.at.record + 1, doc.next_byte, 0)
            if used == row_length:
                yield Row(tuple(pieces), after)
                pieces, used = [], 0
    if partial_last and pieces:
        yield Row(tuple(pieces), after)


@dataclass(frozen=True)
class StreamBatch:
    """A global batch of rows as the collator takes it: the pieces, and rows of indices into them."""

    pieces: list[Sequence[int]]
    batch: IndexBatch
    after: StreamPosition


def as_batch(rows: Sequence[Row], row_length: int) -> StreamBatch:
    pieces: list[Sequence[int]] = []
    indexed = []
    for row in rows:
        indexed.append(tuple(range(len(pieces), len(pieces) + len(row.pieces))))
        pieces.extend(row.pieces)
    flat = tuple(i for row in indexed for i in row)
    return StreamBatch(pieces, IndexBatch(row_length, flat, tuple(indexed)), rows[-1].after)


def global_batches(rows: Iterable[Row], rows_per_batch: int, row_length: int) -> Iterator[StreamBatch]:
    """Global batches of `rows_per_batch` full rows (data.batch_size x workers: each worker collates its own)."""
    chunk: list[Row] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == rows_per_batch:
            yield as_batch(chunk, row_length)
            chunk = []


def held_out(record: int, shard_name: str, holdout: dict[str, int]) -> bool:
    """Whether line `record` of `shard_name` is one of the eval documents (its shard's first lines)."""
    return record < holdout.get(shard_name, 0)


def eval_batches(rows: Sequence[Row], rows_per_batch: int, row_length: int) -> tuple[list[Sequence[int]], list]:
    """The eval rows' pieces, and their batches of `rows_per_batch` rows (the last one may be partial: the
    collator pads it to the same shape)."""
    if not rows:
        return [], []
    whole = as_batch(rows, row_length)
    assert whole.batch.rows is not None
    out = []
    for i in range(0, len(rows), rows_per_batch):
        chunk = whole.batch.rows[i : i + rows_per_batch]
        out.append(IndexBatch(row_length, tuple(j for row in chunk for j in row), chunk))
    return whole.pieces, out
