"""What `neurontrain report` and `compare` read from summary.json besides the figures: the compile timeline,
per-bucket token counts over all workers, the memory plan, what the model and data are, where the run ran."""

from __future__ import annotations

from typing import Any

from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.summary import instance_type
from neurontrain.plan.planning import RunPlan
from neurontrain.recipe import Recipe


def report_fields(
    recipe: Recipe, plan: RunPlan, timeline: list[dict], dp: DataParallel, buckets: dict[int, list[int]]
) -> dict[str, Any]:
    """The summary's report fields. buckets: this worker's length -> [micro-batches, real tokens, slots]
    (summed over the workers here: a collective, every worker calls it)."""
    total: dict[int, list[int]] = {}
    for mine in dp.all_gather_object(buckets):
        for length, counts in mine.items():
            total[length] = [a + b for a, b in zip(total.get(length, [0, 0, 0]), counts)]
    groups = [(g.role, g.instance_type) for g in recipe.cluster.groups]
    return {
        "compiles": timeline,
        "bucket_tokens": [
            {"bucket": n, "batches": c[0], "real_tokens": c[1], "slots": c[2]} for n, c in sorted(total.items())
        ],
        "memory_plan": plan.memory.describe() if plan.memory is not None else None,
        "model_fingerprint": recipe.model_fingerprint(),
        "data_fingerprint": recipe.data_fingerprint(),
        "learning_rate": recipe.train.optimizer.lr,
        "instance_type": instance_type(groups),
    }
