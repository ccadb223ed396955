"""What `submit` checks before a job waits in a queue, without torch or torch-xla (so it takes well under a
second): the recipe itself, the backend name, and the batch arithmetic for the job's worker count.

The full plan (data, tokenizer, buckets, model config) needs torch; `neurontrain run` builds it on the nodes
before any worker starts, and bad input still exits 2 there.
"""

from __future__ import annotations

from neurontrain.errors import UsageError


def check_job(recipe_path: str, overrides: list[str], world: int, backend: str | None = None):
    """Load the recipe with its overrides and check it for `world` workers; returns the recipe."""
    from neurontrain.backend import resolve_backend_name
    from neurontrain.data.sharding import resolve_grad_accum
    from neurontrain.recipe import load_recipe

    recipe = load_recipe(recipe_path, list(overrides) + ([f"runtime.backend={backend}"] if backend else []))
    resolve_backend_name(recipe.runtime.backend)
    data, train = recipe.data, recipe.train
    resolve_grad_accum(data.batch_size, world, train.grad_accum, train.global_batch_size)
    samples = data.train_samples  # known here only when the recipe caps it; else the run checks
    if samples is not None:
        if samples < world:
            raise UsageError(f"{world} workers but only {samples} training samples: every worker needs at least "
                             "one sample a step")
        per_step = data.batch_size * world
        if data.last_batch == "drop" and samples < per_step:
            raise UsageError(f"{samples} training samples make no global batch of {data.batch_size} x {world} "
                             f"workers = {per_step} (with data.last_batch: drop); use fewer workers or a smaller "
                             "data.batch_size")
    return recipe
