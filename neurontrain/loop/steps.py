"""The work of one step, without the sync: shared by the training loop and by graph discovery.

`run` calls these functions and then syncs; `precompile` calls the same functions on the same model,
optimizer and batch shapes and records the pending graph instead of executing it. So a graph that
discovery records is by construction the graph the loop compiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from neurontrain.model.build import ModelDims, eval_statistics, model_inputs
from neurontrain.model.packed import packed_classification
from neurontrain.recipe import Recipe


def forward(model: torch.nn.Module, batch: dict, dims: ModelDims, autocast: Any, precision: str) -> Any:
    with autocast(precision):
        if "cls_positions" in batch:  # packed sequence classification: a prediction per document
            return packed_classification(model, batch, torch.float32, dims.inputs.position_offset)
        return model(**model_inputs(batch, dims, torch.float32))


def micro_step(
    model: torch.nn.Module, batch: dict, recipe: Recipe, dims: ModelDims, autocast: Any, scale: float = 1.0
) -> torch.Tensor:
    """Forward and backward of one micro-batch (the loss multiplied by `scale` for the backward, when it is not
    1); returns the detached loss."""
    loss = forward(model, batch, dims, autocast, recipe.train.precision).loss
    accum = recipe.train.grad_accum
    scaled = loss / accum if accum > 1 else loss
    (scaled * scale if scale != 1.0 else scaled).backward()
    return loss.detach()


def optimizer_step(
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    recipe: Recipe,
    clip: Callable[[list[torch.Tensor], float], Any] = torch.nn.utils.clip_grad_norm_,
) -> float:
    """Clip (with `clip`: torch's, or NxD's under tensor parallel), step, schedule and zero the gradients (kept
    as zero tensors, so every step has the same inputs). Returns the learning rate the step used."""
    if recipe.train.max_grad_norm is not None:
        clip(params, recipe.train.max_grad_norm)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=False)
    return lr


def sharded_optimizer_step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scheduler: Any) -> float:
    """ZeRO-1 on the host path: AdamW over this worker's chunks (their gradients set, reduced and clipped, as
    device data), the schedule, and the full gradients zeroed for the next step's micro-steps. Returns the
    learning rate the step used."""
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)  # the chunks' gradients come in as new device data each step
    for param in params:
        param.grad.zero_()
    return lr


def eval_step(model: torch.nn.Module, batch: dict, recipe: Recipe, dims: ModelDims, autocast: Any) -> torch.Tensor:
    """(loss sum, counted, correct) of one evaluation batch."""
    return eval_statistics(forward(model, batch, dims, autocast, recipe.train.precision), batch["labels"], recipe.task)


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor a step may update: parameters, gradients, the tensors the optimizer steps when they are not
    the model's own (ZeRO-1's chunks) and optimizer state."""
    out: list[torch.Tensor] = []
    own = set()
    for param in model.parameters():
        own.add(id(param))
        out.append(param)
        if param.grad is not None:
            out.append(param.grad)
    if optimizer is not None:
        out += [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
        for state in optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out
