"""AdamW and its learning-rate schedule from a recipe, AdamW's state created before the first step, and the
replicated optimizer (every worker keeps all of AdamW's state; `zero1.py` has the sharded one)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path

import torch

from neurontrain.backends import Backend
from neurontrain.errors import UsageError
from neurontrain.loop import steps
from neurontrain.loop.checkpoints import load_rank_files
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.parallel.zero1_state import consolidate, state_bytes
from neurontrain.recipe import Recipe

ZERO1_WORLD = "zero1_world"  # a ZeRO-1 checkpoint's optimizer entry: {ZERO1_WORLD: ranks}, state in rank files
FSDP_WORLD = "fsdp_world"  # an FSDP2 checkpoint's optimizer entry: {FSDP_WORLD: ranks}, weights and state in DCP


def build_optimizer(recipe: Recipe, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over the model's trainable parameters, with weight decay on matrices only (biases and norms: none)."""
    return build_adamw(recipe, [p for p in model.parameters() if p.requires_grad])


def build_adamw(recipe: Recipe, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    """AdamW over `tensors` (parameters, or ZeRO-1 chunks of them: a chunk keeps its parameter's number of
    dimensions, so it lands in the same group at the same index)."""
    spec = recipe.train.optimizer
    decay, no_decay = [], []
    for param in tensors:
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=spec.lr, betas=spec.betas, eps=spec.eps)


def lr_factor(step: int, max_steps: int, kind: str, warmup: int, min_ratio: float) -> float:
    """LR multiplier for 0-based `step`. Never exactly 0: on XLA the scalars 0 and 1 are baked into the graph
    as constants, so an LR of 0 at one step would compile a graph of its own."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, max_steps - warmup)
    if kind == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(recipe: Recipe, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    s, total = recipe.train.schedule, recipe.train.max_steps
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total, s.kind, s.warmup_steps, s.min_lr_ratio)
    )


def materialize_optimizer_state(optimizer: torch.optim.Optimizer, *, grads: bool = True) -> None:
    """Create AdamW state and (with `grads`) gradient buffers before step 1, as AdamW itself would on its first
    step.

    AdamW creates its state lazily; on XLA that makes the first step a graph of its own. Creating it here
    (then one sync) lets the first step share its bucket's graph with every later step.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if grads and param.grad is None:
                param.grad = torch.zeros_like(param)
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


class Replicated:
    """Every worker keeps the whole AdamW state (one worker, or data parallelism): gradients averaged over the
    workers (`DataParallel.reduce_step`), clipped and stepped on every worker alike."""

    def __init__(self, recipe: Recipe, model: torch.nn.Module, backend: Backend, dp: DataParallel, host: bool) -> None:
        self.recipe, self.backend, self.dp, self.host = recipe, backend, dp, host
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(recipe, model)
        self.scheduler = build_scheduler(recipe, self.optimizer)

    def materialize(self) -> None:
        materialize_optimizer_state(self.optimizer)

    def training_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module a micro-step calls: the model itself (native data parallel: its DDP wrapper)."""
        return model

    def loss_scale(self, items: int) -> float:
        """What a worker's loss is multiplied by before its backward (native data parallel only: its share of
        the step's loss items); 1.0 leaves the graph as it is."""
        return 1.0

    def accumulating(self, more_to_come: bool) -> contextlib.AbstractContextManager:
        """The context of a micro-step's forward and backward (DDP's no_sync before the last micro-batch)."""
        return contextlib.nullcontext()

    def state_tensors(self, model: torch.nn.Module) -> list[torch.Tensor]:
        return steps.state_tensors(model, self.optimizer)

    def step(self, micro_losses: list[torch.Tensor], items: int) -> tuple[float | torch.Tensor | None, float]:
        """Reduce, clip, step, schedule: (global loss as `DataParallel.reduce_step` gives it, learning rate)."""
        loss = self.dp.reduce_step(self.params, micro_losses, items, self.backend, host=self.host)
        return loss, steps.optimizer_step(self.params, self.optimizer, self.scheduler, self.recipe)

    def device_step(self) -> None:
        """The step's graph part with the gradients as they are, no collective: what discovery traces."""
        steps.optimizer_step(self.params, self.optimizer, self.scheduler, self.recipe)

    def after_sync(self) -> None:
        """Nothing: the step's graph updated the parameters."""

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def model_state(self, model: torch.nn.Module) -> dict | None:
        """The weights a checkpoint's state.pt holds (None: they are in the checkpoint's shards)."""
        return model.state_dict()

    def export_state(self, model: torch.nn.Module) -> dict:
        """The whole weights for the final `model/` export; every worker calls it (FSDP2 gathers them)."""
        return model.state_dict()

    def shard_writer(self) -> Callable[[Path], None] | None:
        """What every worker writes into a checkpoint being written (FSDP2: its DCP shards), or None."""
        return None

    def rank_state(self) -> tuple[int, dict] | None:
        return None

    def parameter_digest(self) -> str | None:
        return None

    def optimizer_parameters(self) -> list[torch.Tensor]:
        """The model's parameters in the numbering of the optimizer's state dict (group order)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def load(self, saved: dict, scheduler: dict | None, checkpoint: Path | None) -> None:
        """Resume from a checkpoint's optimizer entry: a plain AdamW state dict (numbered as
        `optimizer_parameters`), or a ZeRO-1 checkpoint's per-rank files consolidated. Without scheduler state
        (`run --init-from`) the schedule starts at its first step."""
        if FSDP_WORLD in saved:
            raise UsageError(
                f"checkpoint {checkpoint} holds FSDP2 shards of {saved[FSDP_WORLD]} workers: resume it with "
                "parallel.fsdp=true on several native workers, or convert it with `neurontrain checkpoint migrate`"
            )
        world = saved.get(ZERO1_WORLD)
        plain = consolidate(load_rank_files(checkpoint, list(range(world))))[0] if world else saved
        self.optimizer.load_state_dict(plain)
        if scheduler is not None:
            self.scheduler.load_state_dict(scheduler)

    def memory(self, model: torch.nn.Module) -> dict[str, int]:
        """Bytes this worker holds on the device, by the memory planner's categories (`device_bytes`)."""
        return device_bytes(model, self.backend.device, moment_tensors(self.optimizer), masters=[])


def moment_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The per-parameter state tensors (AdamW's moments; its scalar step counts not included)."""
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]


def device_bytes(
    model: torch.nn.Module, device: torch.device, moments: list[torch.Tensor], masters: list[torch.Tensor]
) -> dict[str, int]:
    """Bytes of the live tensors on `device` by the memory planner's categories: the model's parameters (tied
    ones once) and their gradients, the optimizer's moments, and the fp32 master copies ZeRO-1 steps. Reads
    shapes and dtypes only: no transfer, no sync."""
    params = list(model.parameters())

    def on_device(tensors: list[torch.Tensor | None]) -> int:
        return state_bytes([t for t in tensors if t is not None and t.device == device])

    return {
        "parameters": on_device(params),
        "gradients": on_device([p.grad for p in params]),
        "optimizer": on_device(moments),
        "master": on_device(masters),
    }
