"""The interface every optimizer strategy follows: how a run's parameters are stepped, reduced over the workers
and saved. `Replicated` (`replicated.py`) is the reference implementation; the others subclass it and change
what differs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch


class Strategy(Protocol):
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR

    def materialize(self) -> None:
        """Create AdamW's state before the first step (its tensors are graph inputs from the first step on)."""

    def training_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module a micro-step calls."""

    def loss_scale(self, items: int) -> float:
        """What a worker's loss is multiplied by before its backward."""

    def accumulating(self, more_to_come: bool) -> contextlib.AbstractContextManager:
        """The context of a micro-step's forward and backward."""

    def state_tensors(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The tensors a step leaves behind (weights and optimizer state): what a sync must compute."""

    def step(self, micro_losses: list[torch.Tensor], items: int) -> tuple[float | torch.Tensor | None, float]:
        """Reduce, clip, step, schedule: (the step's global loss, learning rate)."""

    def device_step(self) -> None:
        """The step's graph part with the gradients as they are, no collective: what discovery traces."""

    def after_sync(self) -> None:
        """What follows the step's graph on the host (ZeRO-1 on the host: the all-gather of the chunks)."""

    def state_dict(self) -> dict:
        """The checkpoint's optimizer entry."""

    def model_state(self, model: torch.nn.Module) -> dict | None:
        """The weights a checkpoint's state.pt holds (None: they are in the checkpoint's shards)."""

    def export_state(self, model: torch.nn.Module) -> dict:
        """The whole weights for the final `model/` export; every worker calls it."""

    def shard_writer(self) -> Callable[[Path], None] | None:
        """What every worker writes into a checkpoint being written, or None."""

    def rank_state(self) -> tuple[int, dict] | None:
        """(rank, state) of a strategy whose checkpoint holds one file per rank, or None."""

    def parameter_digest(self) -> str | None:
        """A digest of the parameters that every worker must agree on, or None."""

    def optimizer_parameters(self) -> list[torch.Tensor]:
        """The model's parameters in the numbering of the optimizer's state dict."""

    def load(self, saved: dict, scheduler: dict | None, checkpoint: Path | None) -> None:
        """Resume from a checkpoint's optimizer entry (without scheduler state the schedule starts over)."""

    def memory(self, model: torch.nn.Module) -> dict[str, int]:
        """Bytes this worker holds on the device, by the memory planner's categories."""
