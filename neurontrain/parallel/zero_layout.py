"""Where each ZeRO-1 worker's share of a parameter lies: torch-xla's `ZeroRedundancyOptimizer` layout.

Every parameter is padded with zero rows on dim 0 up to a multiple of the world size, then cut into `world`
equal chunks of rows; worker r owns chunk r (its optimizer state and fp32 master copy cover those rows only).
NxD's ZeRO-1 optimizer is built on the same class, so state written in this layout interchanges with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def shard_rows(dim0: int, world: int) -> int:
    """Rows of dim 0 in each worker's chunk (the last chunks may be partly or wholly padding)."""
    if world < 1:
        raise ValueError(f"world size {world} must be at least 1")
    return math.ceil(dim0 / world)


def padded_rows(dim0: int, world: int) -> int:
    """Dim 0 after padding to a multiple of the world size."""
    return shard_rows(dim0, world) * world


def shard_shape(shape: Sequence[int], world: int) -> tuple[int, ...]:
    """Shape of one worker's chunk of a parameter of `shape`."""
    if not shape:
        raise ValueError("ZeRO-1 shards parameters on dim 0; a scalar parameter has none")
    return (shard_rows(shape[0], world), *shape[1:])


def shard_numel(shape: Sequence[int], world: int) -> int:
    """Elements of one worker's chunk (padding included): what its optimizer state holds for the parameter."""
    return math.prod(shard_shape(shape, world))


def real_rows(dim0: int, world: int, rank: int) -> range:
    """The rows of the unpadded parameter that worker `rank`'s chunk holds (empty when it is all padding)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    rows = shard_rows(dim0, world)
    start = min(rank * rows, dim0)
    return range(start, min(start + rows, dim0))
