"""AdamW and its learning-rate schedule from a recipe, AdamW's state created before the first step, and what a
worker holds on the device (the strategies that step them: `strategies/`)."""

from __future__ import annotations

import math

import torch

from neurontrain.parallel.zero1_state import state_bytes
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
