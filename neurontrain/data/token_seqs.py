"""Token sequences held as one flat array and offsets, the form the tokenized store keeps on disk.

Pure logic: numpy only. `TokenSeqs` is a read-only sequence of samples over a (possibly memory-mapped) flat token
array: a sample is a view, so a worker's memory grows with the number of samples (their starts and lengths), not
with the number of tokens. Lengths may be cut after loading (`truncate`: a fixed bucket list smaller than
data.max_length), never lengthened.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class TokenSeqs(Sequence):
    """Sample i is tokens[starts[i] : starts[i] + lengths[i]], as a numpy array (a view, no copy)."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, lengths: list[int]) -> None:
        if len(starts) != len(lengths):
            raise ValueError(f"{len(starts)} starts for {len(lengths)} lengths")
        self.tokens, self.starts, self.lengths = tokens, starts, lengths

    @classmethod
    def from_offsets(cls, tokens: np.ndarray, offsets: np.ndarray) -> TokenSeqs:
        """Samples between consecutive offsets (len(offsets) == samples + 1)."""
        return cls(tokens, offsets[:-1], np.diff(offsets).tolist())

    @classmethod
    def from_lists(cls, samples: Iterable[Sequence[int]]) -> TokenSeqs:
        """In memory, from lists of ids (small data and tests)."""
        samples = [list(s) for s in samples]
        lengths = [len(s) for s in samples]
        flat = np.fromiter((t for s in samples for t in s), dtype=np.int64, count=sum(lengths))
        starts = np.zeros(len(samples), dtype=np.int64)
        if samples:
            starts[1:] = np.cumsum(lengths[:-1])
        return cls(flat, starts, lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            raise TypeError("TokenSeqs takes one sample index, not a slice")
        start = int(self.starts[index])
        return self.tokens[start : start + self.lengths[index]]

    def truncate(self, index: int, limit: int) -> None:
        """Cut sample `index` to at most `limit` tokens."""
        self.lengths[index] = min(self.lengths[index], limit)

    @property
    def total_tokens(self) -> int:
        return int(sum(self.lengths))
