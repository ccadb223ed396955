"""Graph discovery by construction: trace every graph of a run's plan once, without executing it.

For each graph key of `RunPlan.expected_graphs()` the step runs through `loop/steps.py` (the functions the
loop calls) on a fresh copy of the run's model and optimizer whose state is device data, as it is after the
loop's set-up sync; the pending graph's HLO is recorded and then dropped unexecuted.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

import torch

from neurontrain.backends import Backend, package_versions
from neurontrain.compile.graphs import graph_hlo, graph_id
from neurontrain.compile.manifest import GraphRecord, Manifest, plan_id
from neurontrain.fileio import write_file_atomic
from neurontrain.loop import steps
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.optim import build_optimizer, build_scheduler, materialize_optimizer_state
from neurontrain.loop.strategies import Strategy, build_strategy
from neurontrain.model.build import build_model, move_to_device
from neurontrain.plan.planning import RunPlan


def run_plan_id(plan: RunPlan, backend: str) -> str:
    workers = f"/world{plan.world}" if plan.world > 1 else ""  # the batch plan and step split depend on it
    if plan.world > 1 and plan.recipe.train.zero1 is True:
        workers += "/zero1"  # the optimizer graph steps chunks (train.zero1 is not part of the fingerprint)
    checkpointing = plan.recipe.train.activation_checkpointing
    if checkpointing != "none":  # recomputed layers change the training graphs; also not in the fingerprint
        workers += f"/checkpointing-{checkpointing}"
    if plan.fsdp:  # FSDP2 compiles layer by layer: other graphs than DDP's (parallel.fsdp is not in it either)
        workers += "/fsdp"
    return plan_id(plan.recipe.fingerprint() + workers, backend, plan.recipe.train.max_steps, plan.expected_graphs())


class _Tracer:
    def __init__(self, plan: RunPlan, backend: Backend) -> None:
        self.plan, self.backend, self.recipe = plan, backend, plan.recipe
        self.device = backend.device
        self.cpu_model = build_model(self.recipe, plan.config)
        cpu_optimizer = build_optimizer(self.recipe, self.cpu_model)
        materialize_optimizer_state(cpu_optimizer)
        self.cpu_optimizer_state = cpu_optimizer.state_dict()
        self.cpu_scheduler_state = build_scheduler(self.recipe, cpu_optimizer).state_dict()
        self.cpu_model.zero_grad(set_to_none=True)
        # worker 0's rows of each global batch: every worker's batch has the same shape
        self.eval_collate = plan.collator("eval", 0)

    def _fresh(self, set_up: bool) -> tuple[torch.nn.Module, Strategy]:
        """Model and optimizer (worker 0's, as the loop builds it) on the device. set_up: state as after the
        loop's set-up sync (device data)."""
        model = move_to_device(copy.deepcopy(self.cpu_model), self.device)
        strategy = build_strategy(self.plan, model, self.backend, DataParallel(0, self.plan.world))
        if set_up:
            strategy.load(self.cpu_optimizer_state, self.cpu_scheduler_state, None)
            for param in model.parameters():
                param.grad = torch.zeros(param.shape, dtype=param.dtype).to(self.device)
        return model, strategy

    def _batch(self, batch: dict) -> tuple[dict, dict]:
        batch.pop("real_tokens")
        batch.pop("loss_items")
        shapes = {k: list(v.shape) for k, v in batch.items()}
        return {k: v.to(self.device) for k, v in batch.items()}, shapes

    def trace(self, key: tuple) -> tuple[list[torch.Tensor], dict]:
        kind = key[0]
        if kind == "setup":
            model, strategy = self._fresh(set_up=False)
            strategy.materialize()
            return strategy.state_tensors(model), {}
        model, strategy = self._fresh(set_up=True)
        if kind == "eval":
            planned = next(b for b in self.plan.eval_batches if b.length == key[1])
            batch, shapes = self._batch(self.eval_collate(planned))
            model.eval()
            with torch.no_grad():
                return [steps.eval_step(model, batch, self.recipe, self.plan.dims, self.backend.autocast)], shapes
        if kind == "optimizer":
            strategy.device_step()
            return strategy.state_tensors(model), {}
        batch, shapes = self._batch(self.plan.first_train_batch(0, key[1]))
        loss = steps.micro_step(model, batch, self.recipe, self.plan.dims, self.backend.autocast)
        if kind == "train":
            strategy.device_step()
        return strategy.state_tensors(model) + [loss], shapes


def discover(
    plan: RunPlan,
    backend: Backend,
    cache_root: Path,
    on_graph: Callable[[GraphRecord], None] | None = None,
    extract: Callable[[Callable[[], None]], list[str]] | None = None,
) -> Manifest:
    """Trace every planned graph; write each HLO under cache_root/graphs/<graph id>/ and return the manifest.
    extract: run the pending graph through the Neuron runtime in extraction mode (given the sync to call) and
    return the module directories the runtime wrote; without it the graph is dropped unexecuted."""
    _ = backend.device  # runtime start-up is paid by run and precompile alike; it is not part of discovery
    start = time.perf_counter()
    tracer = _Tracer(plan, backend)
    manifest = Manifest(
        plan.recipe.name,
        run_plan_id(plan, backend.name),
        backend.name,
        versions={
            k: v for k, v in package_versions().items() if k in ("torch", "torch-xla", "torch-neuronx", "neuronx-cc")
        },
    )
    for key in plan.expected_graphs():
        t0 = time.perf_counter()
        tensors, shapes = tracer.trace(key)
        text, proto = graph_hlo(tensors)
        modules = extract(backend.sync) if extract is not None and text else []
        del tensors  # without extraction: drop the pending graph unexecuted
        gid = graph_id(text)
        rel = f"graphs/{gid}/model.hlo_module.pb"
        if not (cache_root / rel).is_file():
            write_file_atomic(cache_root / rel, proto)
            write_file_atomic(cache_root / f"graphs/{gid}/model.hlo.txt", text.encode())
        record = GraphRecord(list(key), shapes, gid, rel, len(proto), round(time.perf_counter() - t0, 4), modules)
        manifest.graphs.append(record)
        if on_graph:
            on_graph(record)
    manifest.discovery_seconds = round(time.perf_counter() - start, 3)
    return manifest
