"""Sequence packing: whole samples placed into rows of one fixed length, best-fit decreasing.

Pure logic: no torch (numpy). A row holds whole samples (a sample longer than the row has already been cut or refused
by `data.overlong`); where they start is the row's document boundaries. The rows of an epoch depend only on
(lengths, order, row length, document limit), so a resumed run packs exactly the rows an uninterrupted one did.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Packing:
    """How rows are packed: every row has row_length token slots and at most max_docs documents (None: no
    limit; sequence classification needs one, so its per-document outputs have a fixed shape)."""

    row_length: int
    max_docs: int | None = None

    def __post_init__(self) -> None:
        if self.row_length < 1:
            raise ValueError(f"packed rows need a positive length, not {self.row_length}")
        if self.max_docs is not None and self.max_docs < 1:
            raise ValueError(f"packed rows need room for at least one document, not {self.max_docs}")


def pack_rows(lengths: Sequence[int], order: Sequence[int], packing: Packing) -> list[tuple[int, ...]]:
    """Rows of sample indices: best-fit decreasing over the samples of `order` (longest first; equal lengths
    keep their order in `order`, so a shuffled order gives other rows of the same fill). Each sample goes into
    the fullest row it still fits (of several as full, the one that got there last), else opens a new one.
    Rows come out in the order they were opened; a row's samples in the order they were placed.

    Samples of one length come one after another, and the row that takes the first of them stays the fullest
    that fits until it is full: such a run is placed a row at a time (a million samples in about a second)."""
    row_length, max_docs = packing.row_length, packing.max_docs
    indices = np.asarray(order, dtype=np.int64)
    if not len(indices):
        return []
    capped = np.minimum(np.asarray(lengths, dtype=np.int64)[indices], row_length)
    by_length = np.argsort(-capped, kind="stable")
    placed, sizes = indices[by_length].tolist(), capped[by_length]
    bounds = [0, *(np.flatnonzero(np.diff(sizes)) + 1).tolist(), len(placed)]
    rows: list[list[int]] = []
    free_sizes: list[int] = []  # ascending, distinct: at most row_length of them, so insertion stays cheap
    rows_with_free: dict[int, list[int]] = {}  # free slots -> rows that can take another document
    for start, end in zip(bounds[:-1], bounds[1:]):
        need, at_sample = max(int(sizes[start]), 1), start
        while at_sample < end:
            at = bisect.bisect_left(free_sizes, need)
            if at == len(free_sizes):
                rows.append([])
                row, left = len(rows) - 1, row_length
            else:
                left = free_sizes[at]
                waiting = rows_with_free[left]
                row = waiting.pop()
                if not waiting:
                    del free_sizes[at], rows_with_free[left]
            room = left // need if max_docs is None else min(left // need, max_docs - len(rows[row]))
            take = min(room, end - at_sample)
            rows[row].extend(placed[at_sample : at_sample + take])
            at_sample, left = at_sample + take, left - take * need
            if left > 0 and (max_docs is None or len(rows[row]) < max_docs):
                if left not in rows_with_free:
                    bisect.insort(free_sizes, left)
                rows_with_free.setdefault(left, []).append(row)
    return [tuple(row) for row in rows]


def packed_padding_fraction(lengths: Sequence[int], rows: Sequence[Sequence[int]], row_length: int) -> float:
    """Share of the rows' token slots that no sample fills."""
    slots = len(rows) * row_length
    real = sum(min(lengths[i], row_length) for row in rows for i in row)
    return 1.0 - real / slots if slots else 0.0


def document_spans(lengths: Sequence[int], row_length: int) -> list[tuple[int, int]]:
    """(start, length) of each document of a row whose documents have these lengths, in order."""
    spans, start = [], 0
    for length in lengths:
        length = min(length, row_length - start)
        spans.append((start, length))
        start += length
    return spans
