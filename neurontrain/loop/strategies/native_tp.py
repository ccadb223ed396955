"""Tensor parallel on the native backend, alone or under FSDP2 (a [dp, tp] DeviceMesh): the model sharded on the
mesh's "tp" dimension by its transformers plan (`parallel/native_tp.py`), then, with parallel.fsdp and more than
one data-parallel replica, by FSDP2 on its "dp" dimension, as TorchTitan composes them (TP first, FSDP2 over the
TP-sharded DTensors: 2D DTensors on the mesh).

Everything else is FSDP2's strategy (`native_fsdp.py`): AdamW over each worker's DTensor slices, checkpoints
through DCP (each worker writes its slices; a run of another layout reshards them on load), the final export
gathered whole on worker 0, memory counted by local slice. The loss is the same on the TP ranks of one replica
(the head gathers its output), so its gradient is that of the mean loss over the replicas' items as with DDP.
Clipping takes the norm over parameters on different meshes (`native_tp.clip_grad_norm`).
"""

from __future__ import annotations

import torch

from neurontrain.backends import Backend
from neurontrain.loop.strategies.native_fsdp import NativeFSDP
from neurontrain.loop.tp_workers import TensorParallelWorkers
from neurontrain.parallel.native_tp import clip_grad_norm, parallelize, sum_partial_gradients
from neurontrain.plan.planning import RunPlan

TP_DEGREE = "native_tensor_parallel"  # in a checkpoint's optimizer entry: the TP degree that wrote it


class NativeTensorParallel(NativeFSDP):
    """AdamW over this worker's TP (and FSDP2) slices; DCP checkpoints."""

    clip = staticmethod(clip_grad_norm)

    def __init__(self, plan: RunPlan, model: torch.nn.Module, backend: Backend, dp: TensorParallelWorkers) -> None:
        self.partial = parallelize(model, dp.mesh["tp"])
        self.tp, self.tp_group = dp.tp, dp.mesh["tp"].get_group()
        super().__init__(plan.recipe, model, backend, dp, mesh=dp.mesh["dp"])

    def step(self, micro_losses: list[torch.Tensor], items: int) -> tuple[torch.Tensor, float]:
        sum_partial_gradients(self.partial, self.tp_group)
        return super().step(micro_losses, items)

    def device_step(self) -> None:
        sum_partial_gradients(self.partial, self.tp_group)
        super().device_step()

    def state_dict(self) -> dict:
        return {**super().state_dict(), TP_DEGREE: self.tp}
