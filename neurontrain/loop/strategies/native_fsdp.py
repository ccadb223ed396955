"""FSDP2 on the native backend: PyTorch's `fully_shard` over the native device's process group (gloo on the CPU
here, `neuron` on a TorchNeuron host), for models whose weights, gradients and AdamW state do not fit one
device.

Each transformer layer is an FSDP2 unit and a compiled function of its own (`parallel/fsdp_units.py`); the root
unit holds the rest. Every worker keeps 1/world of each parameter (a DTensor sharded on dim 0), of its gradient
and of AdamW's moments; a layer's parameters are all-gathered before its forward and backward, its gradients
reduce-scattered after. The gradient is that of the mean loss over the step's loss items on all workers, as with
DDP (`NativeDataParallel`); with accumulation the micro-batches before the last one skip the reduce-scatter.
Clipping takes the norm of the whole gradient (torch's `clip_grad_norm_` over DTensors). With train.precision
bf16, FSDP2's mixed precision computes in bf16 and reduces gradients in fp32.

Checkpoints: the weights and AdamW's state go to `dcp/` in the checkpoint directory through
torch.distributed.checkpoint (each worker writes its shards; a run of another number of workers reshards them
on load), with the model's `config.json` beside them so `checkpoint migrate` reads the directory as it is;
state.pt keeps the schedule and the data position. The final `model/` export gathers the whole weights.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from neurontrain.backends import Backend
from neurontrain.errors import UsageError
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.optim import FSDP_WORLD, moment_tensors
from neurontrain.loop.strategies.native_ddp import NativeDataParallel
from neurontrain.parallel.fsdp_units import transformer_layers
from neurontrain.parallel.zero1_state import state_bytes
from neurontrain.recipe import Recipe

SHARDS_DIR = "dcp"  # in a checkpoint directory: the DCP checkpoint of weights and AdamW state


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this worker (the tensor itself when it is not a DTensor)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class NativeFSDP(NativeDataParallel):
    """AdamW over this worker's shards of every parameter; gradients reduce-scattered by FSDP2."""

    def __init__(
        self, recipe: Recipe, model: torch.nn.Module, backend: Backend, dp: DataParallel, mesh: Any = None
    ) -> None:
        """mesh: the data-parallel mesh to shard over (FSDP x TP: the "dp" dimension of the 2D mesh, a model
        already sharded on its "tp" dimension); a mesh of one worker shards nothing."""
        from torch.distributed.device_mesh import init_device_mesh  # lazy: only FSDP2 builds a device mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # lazy: as above

        mesh = mesh if mesh is not None else init_device_mesh(backend.device.type, (dp.world,))
        bf16 = recipe.train.precision == "bf16"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        options = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
        if mesh.size() > 1:
            for layer in transformer_layers(model):
                fully_shard(layer, **options)
            fully_shard(model, **options)
        self.model = model
        # DCP's group: every worker writes its own shards (under TP the data-parallel group is not all of them)
        self.checkpoint_group = getattr(dp, "world_group", dp.host_group)
        super().__init__(recipe, model, backend, dp, host=False)  # AdamW over the sharded parameters

    def accumulating(self, more_to_come: bool) -> contextlib.AbstractContextManager:
        if hasattr(self.model, "set_requires_gradient_sync"):  # an FSDP2 module (not so under TP alone)
            self.model.set_requires_gradient_sync(not more_to_come)
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        return {FSDP_WORLD: self.dp.world}

    def model_state(self, model: torch.nn.Module) -> dict | None:
        return None

    def export_state(self, model: torch.nn.Module) -> dict:
        """The whole weights on worker 0's host (gathered from every worker's shards); {} on the others."""
        from torch.distributed.checkpoint.state_dict import (  # lazy: only FSDP2 checkpoints load DCP
            StateDictOptions,
            get_model_state_dict,
        )

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _sharded_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict  # lazy: see export_state

        weights, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": weights, "optimizer": optimizer}

    def shard_writer(self) -> Callable[[Path], None]:
        """Every worker writes its shards to `dcp/` (a collective), then worker 0 the model's config.json."""
        import torch.distributed.checkpoint as dcp  # lazy: see export_state

        def write(directory: Path) -> None:
            shards = str(directory / SHARDS_DIR)
            dcp.save(self._sharded_state(), checkpoint_id=shards, process_group=self.checkpoint_group)
            if self.dp.is_master:
                config = json.loads(self.model.config.to_json_string())
                (directory / SHARDS_DIR / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))

        return write

    def load(self, saved: dict, scheduler: dict | None, checkpoint: Path | None) -> None:
        """Weights and AdamW state from the checkpoint's DCP shards (resharded when another number of workers
        wrote them), then the schedule."""
        import torch.distributed.checkpoint as dcp  # lazy: see export_state
        from torch.distributed.checkpoint.state_dict import set_state_dict  # lazy: as above

        if checkpoint is None:  # `run --init-from`: a whole AdamW state, numbered as the unsharded model's
            raise UsageError(
                "--init-from with parallel.fsdp or native parallel.tp: AdamW's starting state is not loaded into "
                "the shards; add --init-from-weights-only (the weights load before sharding)"
            )
        if FSDP_WORLD not in saved:
            raise UsageError(
                f"checkpoint {checkpoint} holds no FSDP2 shards (written without parallel.fsdp): resume it with "
                "parallel.fsdp=false, or start this run in another --output-dir"
            )
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(checkpoint / SHARDS_DIR), process_group=self.checkpoint_group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if scheduler is not None:
            self.scheduler.load_state_dict(scheduler)

    def memory(self, model: torch.nn.Module) -> dict[str, int]:
        """Bytes of this worker's shards (parameters, gradients, AdamW's moments)."""
        params = list(model.parameters())
        return {
            "parameters": state_bytes([_local(p) for p in params]),
            "gradients": state_bytes([_local(p.grad) for p in params if p.grad is not None]),
            "optimizer": state_bytes([_local(t) for t in moment_tensors(self.optimizer)]),
            "master": 0,
        }
