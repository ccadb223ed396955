"""How the batch arithmetic splits over data-parallel workers: pure logic, no torch.

A step's global batch is per-worker batch x workers x accumulation; each worker collates its own rows of
every global batch.
"""

from __future__ import annotations

from neurontrain.errors import UsageError


def resolve_grad_accum(batch_size: int, world: int, grad_accum: int, global_batch: int | None) -> int:
    """Micro-batches per optimizer step. With train.global_batch_size set, it is derived from
    global = per-worker batch x workers x accumulation, which must divide exactly."""
    if global_batch is None:
        return grad_accum
    per_step = batch_size * world
    if global_batch % per_step:
        raise UsageError(
            f"train.global_batch_size {global_batch} is not divisible by data.batch_size {batch_size} "
            f"x {world} worker{'s' if world > 1 else ''} = {per_step}"
        )
    derived = global_batch // per_step
    if grad_accum not in (1, derived):
        raise UsageError(
            f"train.grad_accum {grad_accum} contradicts train.global_batch_size {global_batch} "
            f"(= {batch_size} x {world} workers x {derived}); set only one of them"
        )
    return derived


def worker_rows(rows: tuple, rank: int, world: int) -> tuple:
    """The rows of a global batch that worker `rank` trains on (samples, or packed rows of samples): every
    world-th, so a partial last batch is spread over the workers instead of leaving the last ones empty."""
    return rows[rank::world]
