"""A run's sequence lengths: the recipe's data.buckets made concrete (fixed lengths, one maximum, the cost
model's choice, or none), then packed rows where data.packing asks for them or the cost model picks them.

Choosing reads the data and changes nothing; fitting the samples to fixed buckets (`fit_to_fixed_buckets`) is
the one step that cuts them, and the plan calls it first.
"""

from __future__ import annotations

from dataclasses import dataclass

from neurontrain.backends.hosts import native_device_type
from neurontrain.data.buckets import StepCostModel, choose_buckets, default_cost_model, round_up
from neurontrain.data.packing import Packing
from neurontrain.data.sources import PreparedData
from neurontrain.errors import UsageError
from neurontrain.model.build import ModelDims
from neurontrain.plan.packing import BucketedSide, decide_packing
from neurontrain.recipe import Recipe


@dataclass
class Buckets:
    lengths: list[int] | None  # None: dynamic padding
    mode: str
    estimate: dict | None = None  # the cost model's figures for auto buckets
    packing: Packing | None = None
    packing_summary: dict | None = None


def cost_key(backend: str) -> str:
    """The cost model's entry for a backend: the native backend's is its device target's (`native-cuda`...)."""
    return f"native-{native_device_type()}" if backend == "native" else backend


def cost_model(recipe: Recipe, backend: str, dims: ModelDims) -> StepCostModel:
    """The backend's cost model for this model (on native: for this host's device target)."""
    return default_cost_model(
        cost_key(backend),
        n_params=dims.n_params,
        n_layers=dims.n_layers,
        hidden=dims.hidden,
        batch_size=recipe.data.batch_size,
        overrides=recipe.data.auto_buckets.model_dump(exclude={"max_buckets"}),
    )


def has_eval(recipe: Recipe, data: PreparedData) -> bool:
    return bool(data.eval_ids) and (recipe.train.eval_every > 0 or recipe.train.eval_at_end)


def fit_to_fixed_buckets(recipe: Recipe, data: PreparedData) -> None:
    """Samples were cut to data.max_length; a fixed bucket list's largest may be smaller than that: cut the longer
    samples to it too (data.overlong: fail refuses them)."""
    spec = recipe.data
    if spec.buckets in ("dynamic", "max", "auto"):
        return
    limit = spec.buckets[-1]
    if max(data.train_lengths + data.eval_lengths) <= limit:
        return
    for split, lengths in (("train", data.train_lengths), ("eval", data.eval_lengths)):
        for i, length in enumerate(lengths):
            if length > limit:
                if spec.overlong == "fail":
                    raise UsageError(f"{split} sample {i} has {length} tokens, more than the largest bucket {limit}")
                if split == "train":
                    data.truncate_train(i, limit)
                else:
                    data.eval_ids.truncate(i, limit)
                data.truncated += 1


def choose(recipe: Recipe, backend: str, data: PreparedData, dims: ModelDims, notes: list[str]) -> Buckets:
    """The recipe's data.buckets made concrete: fixed lengths, one maximum, the cost model's choice, or none."""
    spec = recipe.data
    if spec.buckets == "dynamic":
        notes.append("dynamic padding: one graph per distinct batch length (recompilation storm on XLA)")
        return Buckets(None, "dynamic")
    if spec.buckets == "max":
        return Buckets([spec.max_length], "max")
    if spec.buckets != "auto":
        return Buckets(list(spec.buckets), "fixed")
    choice = choose_buckets(
        data.train_lengths,
        planned_batches=recipe.train.max_steps * recipe.train.grad_accum,
        graphs_per_bucket=1 + (1 if has_eval(recipe, data) else 0),
        cost=cost_model(recipe, backend, dims),
        max_buckets=spec.auto_buckets.max_buckets,
        multiple=spec.pad_to_multiple_of,
        max_length=spec.max_length,
    )
    buckets = list(choice.buckets)
    longest = max(data.train_lengths + data.eval_lengths)
    if buckets[-1] < longest:
        buckets.append(min(round_up(longest, spec.pad_to_multiple_of), spec.max_length))
    estimate = {
        "seconds": round(choice.estimated_seconds, 2),
        "compile_seconds": round(choice.estimated_compile_seconds, 2),
        "step_seconds": round(choice.estimated_step_seconds, 2),
        "padding_fraction": round(choice.padding_fraction, 4),
    }
    return Buckets(buckets, "auto", estimate)


def with_packing(
    recipe: Recipe, backend: str, data: PreparedData, dims: ModelDims, world: int, notes: list[str]
) -> Buckets:
    """The buckets, or one packed row length where data.packing is on or the cost model picks it under auto."""
    buckets = choose(recipe, backend, data, dims, notes)
    decision = decide_packing(
        recipe,
        data,
        dims.inputs,
        BucketedSide(buckets.lengths, buckets.mode, (buckets.estimate or {}).get("seconds")),
        cost=cost_model(recipe, backend, dims),
        graphs_per_bucket=1 + (1 if has_eval(recipe, data) else 0),
        world=world,
    )
    if "reason" in decision.summary:
        notes.append(decision.summary["reason"])
    if decision.packing is None:
        return Buckets(buckets.lengths, buckets.mode, buckets.estimate, None, decision.summary)
    return Buckets([decision.packing.row_length], "packed", buckets.estimate, decision.packing, decision.summary)
