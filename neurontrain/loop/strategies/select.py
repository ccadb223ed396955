"""Which strategy a run's plan calls for."""

from __future__ import annotations

import torch

from neurontrain.backends import Backend
from neurontrain.errors import UsageError
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.strategies.base import Strategy
from neurontrain.loop.strategies.native_ddp import NativeDDP
from neurontrain.loop.strategies.native_fsdp import NativeFSDP
from neurontrain.loop.strategies.native_tp import NativeTensorParallel
from neurontrain.loop.strategies.replicated import Replicated
from neurontrain.loop.strategies.tensor_parallel import TensorParallelAdamW
from neurontrain.loop.strategies.zero1 import HostZero1, InGraphZero1
from neurontrain.plan.planning import RunPlan


def build_strategy(plan: RunPlan, model: torch.nn.Module, backend: Backend, dp: DataParallel) -> Strategy:
    """The optimizer of a run: ZeRO-1 when train.zero1 is true and there is more than one worker (with one,
    there is nothing to shard), else replicated AdamW; under tensor parallel, AdamW over this rank's shards
    (NxD's layers; on native workers DTensors, with FSDP2 over them under parallel.fsdp); on native workers,
    DDP or FSDP2 (parallel.fsdp)."""
    if plan.pp > 1:
        raise UsageError(f"parallel.pp {plan.pp}: {plan.backend} does not train pipeline stages yet")
    if plan.tp > 1 and backend.is_native:
        return NativeTensorParallel(plan, model, backend, dp)
    if plan.tp > 1:
        return TensorParallelAdamW(plan, model, backend, dp)
    if backend.is_native and plan.world > 1:
        return (NativeFSDP if plan.fsdp else NativeDDP)(plan.recipe, model, backend, dp)
    if plan.recipe.train.zero1 is True and plan.world > 1:
        if plan.host_reduce:
            return HostZero1(plan.recipe, model, backend, dp)
        return InGraphZero1(plan.recipe, model, backend, dp)
    return Replicated(plan.recipe, model, backend, dp, plan.host_reduce)
