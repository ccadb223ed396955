"""What `submit` checks before a job waits in a queue, without torch or torch-xla (so it takes well under a
second): the recipe itself, the backend name, and the batch arithmetic for the job's worker count.

The full plan (data, tokenizer, buckets, model config) needs torch; `neurontrain run` builds it on the nodes
before any worker starts, and bad input still exits 2 there.
"""

from __future__ import annotations

from neurontrain.backends import resolve_backend_name
from neurontrain.data.sharding import resolve_grad_accum
from neurontrain.errors import UsageError
from neurontrain.recipe import Recipe, load_recipe


def load_job_recipe(recipe_path: str, overrides: list[str]) -> Recipe:
    """The recipe with its overrides, its backend name checked."""
    recipe = load_recipe(recipe_path, list(overrides))
    resolve_backend_name(recipe.runtime.backend)
    return recipe


def check_world(recipe: Recipe, world: int) -> None:
    """The recipe's batch arithmetic for `world` workers."""
    data, train = recipe.data, recipe.train
    resolve_grad_accum(data.batch_size, world, train.grad_accum, train.global_batch_size)
    samples = data.train_samples  # known here only when the recipe caps it; else the run checks
    if samples is None:
        return
    if samples < world:
        raise UsageError(
            f"{world} workers but only {samples} training samples: every worker needs at least one sample a step"
        )
    per_step = data.batch_size * world
    if data.last_batch == "drop" and samples < per_step:
        raise UsageError(
            f"{samples} training samples make no global batch of {data.batch_size} x {world} workers = {per_step} "
            "(with data.last_batch: drop); use fewer workers or a smaller data.batch_size"
        )
