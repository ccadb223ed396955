"""What a run's layout may be, before any data is prepared: the pinned tensor-parallel and pipeline degrees
checked against the workers, what each backend trains, and what a plan says of its pipeline."""

from __future__ import annotations

from neurontrain.errors import UsageError
from neurontrain.model.hub_kernels import hub_kernels
from neurontrain.recipe import Recipe


def pinned_tp(recipe: Recipe, world: int) -> int:
    """The recipe's parallel.tp when it is a number (1 for auto), checked against the number of workers."""
    tp = recipe.parallel.tp if recipe.parallel.tp != "auto" else 1
    if world % tp:
        raise UsageError(f"parallel.tp: {tp} needs a multiple of {tp} workers (this run has {world})")
    return tp


def check_backend(recipe: Recipe, backend: str, world: int, tp: int, pp: int = 1) -> None:
    """Refuse what the backend does not train (before any data is prepared)."""
    hub_kernels(recipe, backend)
    if backend == "native" and tp > 1 and world > tp * pp and not recipe.parallel.fsdp:
        raise UsageError(
            f"backend native: parallel.tp: {tp} on {world} workers needs parallel.fsdp: true (FSDP2 x TP on a 2D "
            "mesh; DDP over tensor-parallel DTensors is not built)"
        )
    if backend == "native" and world > 1 and recipe.train.zero1 is True:
        raise UsageError(
            "backend native: train.zero1 is not built on the native backend (parallel.fsdp shards AdamW's state)"
        )
    if recipe.parallel.fsdp and backend != "native":
        raise UsageError(
            f"parallel.fsdp: FSDP2 runs on the native backend (--backend native); on {backend}, train.zero1 "
            "shards the optimizer state"
        )


def pinned_stages(recipe: Recipe, world: int, tp: int) -> int:
    """The recipe's parallel.pp when it is a number (1 for auto), checked against the workers and the TP degree."""
    pp = recipe.parallel.pp if recipe.parallel.pp != "auto" else 1
    if world % (tp * pp):
        raise UsageError(
            f"parallel.pp: {pp} stages x parallel.tp {tp} need a multiple of {tp * pp} workers (this run has {world})"
        )
    return pp


def pipeline_notes(backend: str, pp: int) -> list[str]:
    """What a plan with `pp` stages says of them."""
    if pp == 1:
        return []
    return [
        f"pipeline parallel: {pp} stages; {backend} does not train pipeline stages yet: this plan sizes the layout "
        "(`run` refuses it)"
    ]
