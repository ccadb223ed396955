"""`neurontrain precompile` on the native backend: compile every planned graph as `run` would, then keep
PyTorch's portable compile artifacts as one verified cache entry (compile/native_cache.py).

The model is built, moved and compiled as the trainer's set-up does (`build_model`, `Backend.compile_model`:
`nn.Module.compile` with static shapes), its optimizer state materialized as there; each train key then runs
the loop's own micro-step (forward and backward: AOTAutograd compiles the backward graph with the forward) on
the first planned batch of its length, each eval key the loop's eval step under no_grad in eval mode, with the
recipe's precision. AdamW, the schedule and clipping run eagerly on native: no graph of theirs to compile.
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
from neurontrain.errors import NeurontrainError, UsageError
from neurontrain.loop import steps
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.strategies import build_strategy
from neurontrain.model.build import build_model, move_to_device
from neurontrain.model.packed import prepare_packed_classifier
from neurontrain.plan.planning import RunPlan


@dataclass
class NativePrecompileReport:
    """What `precompile --backend native` did; its fields are the JSON report."""

    target: str
    entry: str
    planned_graphs: int
    graphs_compiled: int = 0  # TorchDynamo graphs compiled (one per planned key when nothing breaks)
    already_cached: bool = False  # the entry was there and matched its record: nothing compiled
    seconds: float = 0.0
    artifact_bytes: int = 0
    cache_counters: dict = field(default_factory=dict)
    graphs: list[dict] = field(default_factory=list)
    note: str = ""

    def table(self) -> str:
        lines = [f"{'graph':<22} {'shapes':<14} {'seconds':>8}"]
        lines += [f"{' '.join(map(str, g['key'])):<22} {g['shapes']:<14} {g['seconds']:>8.2f}" for g in self.graphs]
        status = "already cached" if self.already_cached else f"{self.graphs_compiled} graphs compiled"
        lines.append(
            f"native: {self.planned_graphs} planned graphs, {status}, {self.artifact_bytes} bytes of artifacts "
            f"in {self.entry}, {self.seconds:.1f} s"
        )
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {**asdict(self), "seconds": round(self.seconds, 3)}


def _run_key(plan: RunPlan, backend: Backend, model: torch.nn.Module, key: tuple) -> dict:
    """Run one planned key's step once (compiling its graph); returns its batch shapes."""
    recipe, kind, length = plan.recipe, key[0], key[1]
    if kind == "eval":
        batch = plan.collator("eval", 0)(next(b for b in plan.eval_batches if b.length == length))
    else:
        batch = plan.first_train_batch(0, length)
    batch.pop("real_tokens")
    batch.pop("loss_items")
    batch = {k: v.to(backend.device) for k, v in batch.items()}
    if kind == "eval":
        model.eval()
        with torch.no_grad():
            steps.eval_step(model, batch, recipe, plan.dims, backend.autocast)
        model.train()
    else:
        steps.micro_step(model, batch, recipe, plan.dims, backend.autocast)
    return {"input_ids": list(batch["input_ids"].shape)}


def check_native_precompile(plan: RunPlan, backend: Backend) -> None:
    """UsageError for what the native precompile does not do."""
    if backend.compiler not in ("inductor", "neuron"):
        raise UsageError(
            f"precompile --backend native with torch.compile backend {backend.compiler!r}: only inductor's "
            "artifacts and TorchNeuron's NEFF cache are kept"
        )
    if plan.world > 1:
        raise UsageError("precompile --backend native: one worker only (the native backend trains on one for now)")


def precompile_native(plan: RunPlan, backend: Backend, cache_root: Path) -> NativePrecompileReport:
    """Compile every planned key of the plan and write the entry (unless one there matches its record)."""
    check_native_precompile(plan, backend)
    start = time.perf_counter()
    keys = plan.expected_graphs()
    path = native_entry_path(plan, backend.native_device, backend.compiler)
    report = NativePrecompileReport(backend.compiler, path, len(keys))
    if (cache_root / path).exists() and entry_problem(cache_root / path) is None:
        report.already_cached = True
        report.artifact_bytes = (cache_root / path / ARTIFACTS).stat().st_size
        report.seconds = time.perf_counter() - start
        return report
    neff_dir = point_neff_cache(os.environ, cache_root) if backend.native_device == "neuron" else None
    alone = DataParallel(0, plan.world)
    alone.start(backend, plan.recipe.runtime.collective_timeout)  # TorchNeuron: its group before the device
    model = build_model(plan.recipe, plan.config)
    move_to_device(model, backend.device)
    prepare_packed_classifier(model, plan.recipe.task, plan.packing)
    backend.compile_model(model, len(keys))
    build_strategy(plan, model, backend, alone).materialize()
    before, graphs_before = counts_now(), backend.compile_count()
    for key in keys:
        t0 = time.perf_counter()
        shapes = _run_key(plan, backend, model, key)
        report.graphs.append(
            {
                "key": list(key),
                "shapes": "x".join(map(str, shapes["input_ids"])),
                "seconds": round(time.perf_counter() - t0, 3),
            }
        )
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
