"""data.packing made concrete: whether a run packs its rows, at which length, and what either way costs.

`run --dry-run` shows both sides (padding, steps per epoch, the cost model's seconds) whatever the recipe
says; `data.packing: auto` takes the cheaper one and says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from neurontrain.data.buckets import StepCostModel, bucketing_seconds, padding_fraction, round_up
from neurontrain.data.packing import Packing, pack_rows, packed_padding_fraction
from neurontrain.data.sharding import resolve_grad_accum
from neurontrain.data.sources import PreparedData
from neurontrain.errors import UsageError
from neurontrain.model.inputs import ModelInputs
from neurontrain.recipe import Recipe


def docs_limit(shortest: int, row_length: int, cap: int = 64) -> int:
    """The documents a row may hold when the recipe does not say: as many of the shortest sample as fit, at
    most `cap` (each is one slot of the per-document outputs, padding included)."""
    return max(1, min(cap, row_length // max(shortest, 1)))


@dataclass(frozen=True)
class PackingEstimate:
    """What packing one epoch of these samples gives, and the cost model's seconds for packed steps that cover
    the samples of `planned_batches` unpacked batches (batches of batch_size samples there, of rows here)."""

    rows: int
    samples: int
    padding_fraction: float
    steps: float
    seconds: float
    compile_seconds: float

    @property
    def documents_per_row(self) -> float:
        return self.samples / self.rows if self.rows else 0.0


def estimate_packing(
    lengths: Sequence[int], packing: Packing, *, planned_batches: int, graphs: int, cost: StepCostModel
) -> PackingEstimate:
    rows = pack_rows(lengths, range(len(lengths)), packing)
    steps = planned_batches * len(rows) / max(len(lengths), 1)
    compile_seconds = graphs * cost.compile_seconds
    return PackingEstimate(
        rows=len(rows),
        samples=len(lengths),
        padding_fraction=packed_padding_fraction(lengths, rows, packing.row_length),
        steps=steps,
        seconds=compile_seconds + steps * cost.step_seconds(packing.row_length),
        compile_seconds=compile_seconds,
    )


def packing_refusal(inputs: ModelInputs, task: str, num_labels: int, row_length: int) -> str | None:
    """Why a run of `task` with rows of `row_length` tokens cannot pack this model, or None."""
    if inputs.unpackable:
        return inputs.unpackable
    if task == "sequence-classification" and num_labels < 2:
        return "sequence classification packs only with model.num_labels of 2 or more"
    if inputs.sliding_window is not None and inputs.sliding_window < row_length:
        return (
            f"the model's sliding window of {inputs.sliding_window} tokens is shorter than the packed rows' "
            f"{row_length} (the per-document mask does not apply the window)"
        )
    return None


@dataclass(frozen=True)
class BucketedSide:
    """The unpacked alternative as the plan has it: its buckets (None: dynamic padding) and the cost model's
    seconds for them when it estimated them (auto buckets)."""

    lengths: list[int] | None
    mode: str
    seconds: float | None = None


@dataclass
class PackingDecision:
    packing: Packing | None  # None: the run does not pack
    summary: dict = field(default_factory=dict)  # for the plan description


def row_length(recipe: Recipe, longest: int, bucketed: BucketedSide) -> int:
    """Rows are as long as the longest bucket the run would have: a fixed list's last, data.max_length for
    `max`, else the longest sample rounded up to data.pad_to_multiple_of (at most data.max_length)."""
    spec = recipe.data
    if bucketed.mode == "fixed" and bucketed.lengths:
        return bucketed.lengths[-1]
    if bucketed.mode == "max":
        return spec.max_length
    return min(round_up(longest, spec.pad_to_multiple_of), spec.max_length)


def _unpacked_lengths(lengths: Sequence[int], bucketed: BucketedSide, multiple: int) -> list[int]:
    """Dynamic padding has no buckets: every distinct rounded length stands for one."""
    if bucketed.lengths is not None:
        return bucketed.lengths
    return sorted({round_up(n, multiple) for n in lengths})


def _reason(chosen: bool, packed: PackingEstimate, bucketed_seconds: float, bucketed: BucketedSide) -> str:
    what = "packing" if chosen else "no packing"
    return (
        f"data.packing auto: {what}: the cost model puts packed rows at {packed.seconds:.1f} s "
        f"({packed.documents_per_row:.1f} samples a row, padding "
        f"{packed.padding_fraction:.2f}) against {bucketed_seconds:.1f} s for buckets {bucketed.lengths or 'dynamic'} "
        "on the same samples"
    )


def decide_packing(
    recipe: Recipe,
    data: PreparedData,
    inputs: ModelInputs,
    bucketed: BucketedSide,
    *,
    cost: StepCostModel,
    graphs_per_bucket: int,
    world: int,
) -> PackingDecision:
    spec, task = recipe.data, recipe.task
    lengths = data.train_lengths
    length = row_length(recipe, max(lengths + data.eval_lengths), bucketed)
    max_docs = spec.max_docs_per_row
    if max_docs is None and task == "sequence-classification":
        max_docs = docs_limit(min(lengths + data.eval_lengths), length)
    packing = Packing(length, max_docs)
    planned = recipe.train.max_steps * recipe.train.grad_accum
    packed = estimate_packing(
        [min(n, length) for n in lengths], packing, planned_batches=planned, graphs=graphs_per_bucket, cost=cost
    )
    unpacked = _unpacked_lengths(lengths, bucketed, spec.pad_to_multiple_of)
    seconds = bucketed.seconds
    if seconds is None:
        seconds = bucketing_seconds(
            [min(n, unpacked[-1]) for n in lengths],
            unpacked,
            planned_batches=planned,
            graphs_per_bucket=graphs_per_bucket,
            cost=cost,
        )
    rows_per_step = spec.batch_size * world
    summary = {
        "mode": spec.packing,
        "row_length": length,
        "max_docs_per_row": max_docs,
        "samples_per_row": round(packed.documents_per_row, 2),
        "padding_fraction": round(packed.padding_fraction, 4),
        "steps_per_epoch": round(packed.rows / rows_per_step, 1),
        "estimate_seconds": round(packed.seconds, 2),
        "unpacked": {
            "padding_fraction": round(padding_fraction([min(n, unpacked[-1]) for n in lengths], unpacked), 4),
            "steps_per_epoch": round(len(lengths) / rows_per_step, 1),
            "estimate_seconds": round(seconds, 2),
        },
    }
    if spec.packing == "off":
        return PackingDecision(None, summary | {"chosen": False})
    unpackable = packing_refusal(inputs, task, recipe.model.num_labels, length)
    if spec.packing == "on":
        if unpackable:
            raise UsageError(f"data.packing: on: {unpackable}; set data.packing: off")
        return PackingDecision(packing, summary | {"chosen": True})
    if unpackable:
        reason = f"data.packing auto: no packing: {unpackable}"
        return PackingDecision(None, summary | {"chosen": False, "reason": reason})
    return _auto_choice(packing, packed, seconds, bucketed, spec.batch_size, summary)


def _auto_choice(
    packing: Packing, packed: PackingEstimate, seconds: float, bucketed: BucketedSide, batch_size: int, summary: dict
) -> PackingDecision:
    """data.packing auto: the cheaper side; packed, with the rows that hold about batch_size samples a step."""
    chosen = packed.seconds < seconds
    reason = _reason(chosen, packed, seconds, bucketed)
    if not chosen:
        return PackingDecision(None, summary | {"chosen": False, "reason": reason})
    rows = packed_rows(batch_size, packed.documents_per_row)
    reason += (
        f"; {rows} packed rows a step (about {rows * packed.documents_per_row:.0f} samples: a step sees about the "
        f"data.batch_size {batch_size} samples an unpacked step does)"
    )
    return PackingDecision(packing, summary | {"chosen": True, "reason": reason, "rows_per_step": rows})


def packed_rows(batch_size: int, samples_per_row: float) -> int:
    """Packed rows a step takes under data.packing auto: as many as hold about data.batch_size samples (at least
    one), so a step means what it meant unpacked (same samples, same learning-rate scale), with less padding."""
    return max(1, round(batch_size / max(samples_per_row, 1.0)))


def with_packed_rows(recipe: Recipe, summary: dict | None, world: int = 1) -> Recipe:
    """The recipe with data.batch_size (and an unset data.eval_batch_size's rows) as the packed rows auto chose.
    A train.global_batch_size counts samples: it becomes the accumulation it gives unpacked on `world` workers
    (a step keeps about its samples; the packed rows need not divide it)."""
    rows = (summary or {}).get("rows_per_step")
    spec, train = recipe.data, recipe.train
    if rows is None or rows == spec.batch_size:
        return recipe
    update = {"batch_size": rows, "eval_batch_size": spec.eval_batch_size or spec.batch_size}
    changes = {"data": spec.model_copy(update=update)}
    if train.global_batch_size is not None:
        accum = resolve_grad_accum(spec.batch_size, world, train.grad_accum, train.global_batch_size)
        changes["train"] = train.model_copy(update={"grad_accum": accum, "global_batch_size": None})
    return recipe.model_copy(update=changes)
