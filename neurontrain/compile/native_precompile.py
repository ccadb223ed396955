"""`neurontrain precompile` on the native backend: compile every planned graph as `run` would, then keep
PyTorch's portable compile artifacts as one verified cache entry (compile/native_cache.py).

The model is built, moved and compiled as the trainer's set-up does (`build_model`, `Backend.compile_model`:
`nn.Module.compile` with static shapes), its optimizer state materialized as there; each train key then runs
the loop's own micro-step (forward and backward: AOTAutograd compiles the backward graph with the forward) on
the first planned batch of its length, each eval key the loop's eval step under no_grad in eval mode, with the
recipe's precision. AdamW, the schedule and clipping run eagerly on native: no graph of theirs to compile.

For a layout of several workers (`--nproc-per-node N --nnodes M`) the process is set up as one of them, with DDP
or FSDP2 around the model as in the worker (compile/trace_group.py: a process group without peers), and the keys
run on that worker's own batches; workers that see the same shapes share their graphs, so one of each group of
them is compiled (on DDP and FSDP2 every worker sees the same shapes: one compile of each graph).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from neurontrain.backends import Backend, package_versions
from neurontrain.compile.discover import run_plan_id
from neurontrain.compile.native_cache import (
    ARTIFACTS,
    counts_now,
    counts_since,
    entry_problem,
    native_entry_path,
    write_entry,
)
from neurontrain.compile.neff_cache import archive_neffs, point_neff_cache
from neurontrain.compile.trace_group import distinct_ranks, join_as, leave
from neurontrain.errors import NeurontrainError, UsageError
from neurontrain.loop import steps
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.strategies import build_strategy
from neurontrain.model.build import build_model, move_to_device
from neurontrain.model.packed import prepare_packed_classifier
from neurontrain.parallel.fsdp_units import planned_graph_count, transformer_layers
from neurontrain.plan.planning import RunPlan


@dataclass
class NativePrecompileReport:
    """What `precompile --backend native` did; its fields are the JSON report."""

    target: str
    entry: str
    planned_graphs: int
    workers: int = 1  # the layout's workers (--nproc-per-node x --nnodes)
    ranks_compiled: dict = field(default_factory=dict)  # representative rank -> the ranks that share its graphs
    graphs_compiled: int = 0  # TorchDynamo graphs compiled (one per planned key when nothing breaks)
    already_cached: bool = False  # the entry was there and matched its record: nothing compiled
    seconds: float = 0.0
    artifact_bytes: int = 0
    cache_counters: dict = field(default_factory=dict)
    graphs: list[dict] = field(default_factory=list)
    note: str = ""

    def table(self) -> str:
        lines = [f"{'graph':<22} {'rank':>4} {'shapes':<14} {'seconds':>8}"]
        lines += [
            f"{' '.join(map(str, g['key'])):<22} {g['rank']:>4} {g['shapes']:<14} {g['seconds']:>8.2f}"
            for g in self.graphs
        ]
        status = "already cached" if self.already_cached else f"{self.graphs_compiled} graphs compiled"
        lines.append(
            f"native: {self.planned_graphs} planned graphs, {self.workers} worker(s) sharing "
            f"{len(self.ranks_compiled) or 1} set(s) of graphs, {status}, {self.artifact_bytes} bytes of artifacts "
            f"in {self.entry}, {self.seconds:.1f} s"
        )
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {**asdict(self), "seconds": round(self.seconds, 3)}


def _collated(plan: RunPlan, key: tuple, rank: int) -> dict:
    """Worker `rank`'s first planned batch of `key`, collated on the host (without the loop's counts)."""
    if key[0] == "eval":
        batch = plan.collator("eval", rank)(next(b for b in plan.eval_batches if b.length == key[1]))
    else:
        batch = plan.first_train_batch(rank, key[1])
    batch.pop("real_tokens")
    batch.pop("loss_items")
    return batch


def rank_shapes(plan: RunPlan, keys: list[tuple]) -> dict[int, list]:
    """Each worker's batch shapes at every planned key: what decides the graphs it compiles."""
    return {
        rank: [{k: list(v.shape) for k, v in sorted(_collated(plan, key, rank).items())} for key in keys]
        for rank in range(plan.world)
    }


def _run_key(plan: RunPlan, backend: Backend, model: torch.nn.Module, training: torch.nn.Module, key: tuple,
             rank: int) -> dict:  # fmt: skip
    """Run one planned key's step once as worker `rank` (compiling its graph), as the loop does: training through
    the strategy's module (DDP's wrapper), evaluation on the model itself; returns its batch shapes."""
    recipe = plan.recipe
    batch = {k: v.to(backend.device) for k, v in _collated(plan, key, rank).items()}
    if key[0] == "eval":
        model.eval()
        with torch.no_grad():
            steps.eval_step(model, batch, recipe, plan.dims, backend.autocast)
        model.train()
    else:
        steps.micro_step(training, batch, recipe, plan.dims, backend.autocast)
    return {"input_ids": list(batch["input_ids"].shape)}


def check_native_precompile(plan: RunPlan, backend: Backend) -> None:
    """UsageError for what the native precompile does not do."""
    if backend.compiler not in ("inductor", "neuron"):
        raise UsageError(
            f"precompile --backend native with torch.compile backend {backend.compiler!r}: only inductor's "
            "artifacts and TorchNeuron's NEFF cache are kept"
        )
    if plan.tp > 1:
        raise UsageError("precompile --backend native: tensor parallelism is not built on the native backend")


def _claim_device(plan: RunPlan, backend: Backend) -> DataParallel:
    """The device for this process, as a worker's set-up takes it: on TorchNeuron the `neuron` process group of
    one first (it assigns the cores), then the runtime started by a first allocation. For a layout of several
    workers that group is left again: the ranks are then traced in a process group without peers."""
    alone = DataParallel(0, 1)
    alone.start(backend, plan.recipe.runtime.collective_timeout)
    if plan.world > 1:
        torch.empty(1, device=backend.device)
        alone.close()
    return alone


def _compile_rank(plan: RunPlan, backend: Backend, rank: int, groups: int, report: NativePrecompileReport) -> None:
    """Set up the model as worker `rank` does (`Trainer._set_up`: FSDP2's units compiled one by one, DDP or FSDP2
    around it) and run every planned key once."""
    dp = DataParallel(rank, plan.world)
    if plan.world > 1:
        join_as(rank, plan.world, backend.native_device)
    model = build_model(plan.recipe, plan.config)
    move_to_device(model, backend.device)
    units = transformer_layers(model) if plan.fsdp else None
    prepare_packed_classifier(model, plan.recipe.task, plan.packing)
    planned = planned_graph_count(len(plan.expected_graphs()), len(units or []), plan.fsdp) * groups
    backend.compile_model(model, planned, units)
    strategy = build_strategy(plan, model, backend, dp)
    strategy.materialize()
    for key in plan.expected_graphs():
        t0 = time.perf_counter()
        shapes = _run_key(plan, backend, model, strategy.training_module(model), key, rank)
        report.graphs.append(
            {
                "key": list(key),
                "rank": rank,
                "shapes": "x".join(map(str, shapes["input_ids"])),
                "seconds": round(time.perf_counter() - t0, 3),
            }
        )
    del strategy, model
    if plan.world > 1:
        leave()


def precompile_native(plan: RunPlan, backend: Backend, cache_root: Path) -> NativePrecompileReport:
    """Compile every planned key of the plan, once for each group of workers that see the same shapes, and write
    the entry (unless one there matches its record)."""
    check_native_precompile(plan, backend)
    start = time.perf_counter()
    keys = plan.expected_graphs()
    path = native_entry_path(plan, backend.native_device, backend.compiler)
    report = NativePrecompileReport(backend.compiler, path, len(keys), workers=plan.world)
    if (cache_root / path).exists() and entry_problem(cache_root / path) is None:
        report.already_cached = True
        report.artifact_bytes = (cache_root / path / ARTIFACTS).stat().st_size
        report.seconds = time.perf_counter() - start
        return report
    neff_dir = point_neff_cache(os.environ, cache_root) if backend.native_device == "neuron" else None
    groups = distinct_ranks(rank_shapes(plan, keys))
    report.ranks_compiled = {str(rep): members for rep, members in groups.items()}
    alone = _claim_device(plan, backend)
    before, graphs_before = counts_now(), backend.compile_count()
    for rank in groups:
        _compile_rank(plan, backend, rank, len(groups), report)
    report.graphs_compiled = backend.compile_count() - graphs_before
    report.cache_counters = counts_since(before)
    report.note = "; ".join(backend.compile_notes())
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        raise NeurontrainError("precompile --backend native: PyTorch recorded no compile artifacts")
    artifacts = saved[0]
    meta = {
        "recipe": plan.recipe.name,
        "plan_id": run_plan_id(plan, "native"),
        "workers": plan.world,
        "device": backend.native_device,
        "compiler": backend.compiler,
        "graphs": [list(k) for k in keys],
        "versions": {k: v for k, v in package_versions().items() if k in ("torch", "transformers")},
        "artifacts": {kind: len(names) for kind, names in saved[1].artifacts.items()},
    }
    write_entry(cache_root, path, artifacts, meta, archive_neffs(neff_dir) if neff_dir is not None else None)
    alone.close()
    report.artifact_bytes = len(artifacts)
    report.seconds = time.perf_counter() - start
    return report
