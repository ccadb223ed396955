"""Data parallelism on the native backend: PyTorch's own `DistributedDataParallel` around the model compiled in
place, over the native device's process group (gloo on the CPU here, `neuron` on a TorchNeuron host).

The gradient is the gradient of the mean loss over every loss item of the step on all workers, as on the other
backends: before the step's first backward each worker learns the step's item count on all workers (one small
host all-reduce) and scales its loss by its share, items x world / all items, so DDP's average across the
workers weighs each worker by its items. With accumulation the micro-batches before the last one run under
`no_sync()`: DDP reduces once, in the last backward.

TorchDynamo's DDP optimizer (`optimize_ddp`) would split each compiled graph at DDP's bucket boundaries, so a
planned shape would compile into several graphs and the plan's count would no longer hold; it is turned off:
one graph per planned shape, with DDP's all-reduce after the compiled backward (no overlap of communication
with the backward, which matters little on one host and keeps the recompilation guard exact).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from neurontrain.backends import Backend
from neurontrain.loop import steps
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.strategies.replicated import Replicated
from neurontrain.recipe import Recipe


class NativeDataParallel(Replicated):
    """What native DDP and FSDP2 share: the loss scaled by the worker's share of the step's loss items (both
    average the gradients over the workers), and the global loss summed over the process group."""

    clip = staticmethod(torch.nn.utils.clip_grad_norm_)  # tensor parallel: its own, over DTensors of two meshes

    def loss_scale(self, items: int) -> float:
        """This worker's share of the step's loss items, times the number of workers (DDP averages)."""
        total = float(self.dp.all_reduce_host(torch.tensor([float(items)], dtype=torch.float64))[0])
        return items * self.dp.world / total if total > 0 else 0.0

    def step(self, micro_losses: list[torch.Tensor], items: int) -> tuple[torch.Tensor, float]:
        """Clip, step, schedule (the gradients are reduced already); the global loss as a device scalar: the
        item-weighted mean of the workers' losses, summed over the process group without a host read."""
        mean = torch.stack(micro_losses).mean() if micro_losses else torch.zeros((), device=self.backend.device)
        stats = torch.stack([mean * items, torch.tensor(float(items), device=mean.device)])
        dist.all_reduce(stats)
        loss = stats[0] / stats[1].clamp(min=1.0)
        return loss, steps.optimizer_step(self.params, self.optimizer, self.scheduler, self.recipe, clip=self.clip)

    def device_step(self) -> None:
        steps.optimizer_step(self.params, self.optimizer, self.scheduler, self.recipe, clip=self.clip)


class NativeDDP(NativeDataParallel):
    """Replicated AdamW on every worker; gradients reduced by DDP during the backward."""

    def __init__(self, recipe: Recipe, model: torch.nn.Module, backend: Backend, dp: DataParallel) -> None:
        import torch._dynamo  # lazy: TorchDynamo loads in seconds and only the native backend uses it
        from torch.nn.parallel import DistributedDataParallel  # lazy: only native data parallel wraps the model

        torch._dynamo.config.optimize_ddp = False
        super().__init__(recipe, model, backend, dp, host=False)
        self.ddp = DistributedDataParallel(model, broadcast_buffers=False)

    def training_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.ddp

    def accumulating(self, more_to_come: bool) -> contextlib.AbstractContextManager:
        return self.ddp.no_sync() if more_to_come else contextlib.nullcontext()
