"""Replicated AdamW: every worker keeps the whole optimizer state (one worker, or data parallelism). The
reference implementation of `Strategy`: the other strategies subclass it and change what differs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch

from neurontrain.backends import Backend
from neurontrain.errors import UsageError
from neurontrain.loop import steps
from neurontrain.loop.checkpoints import load_rank_files
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.optim import (
    FSDP_WORLD,
    ZERO1_WORLD,
    build_optimizer,
    build_scheduler,
    device_bytes,
    materialize_optimizer_state,
    moment_tensors,
)
from neurontrain.model.lora import checkpoint_weights
from neurontrain.parallel.zero1_state import consolidate
from neurontrain.recipe import Recipe


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
        """The weights a checkpoint's state.pt holds (None: they are in the checkpoint's shards; with LoRA the
        trained tensors only)."""
        return checkpoint_weights(model)

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
