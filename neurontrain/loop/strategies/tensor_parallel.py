"""AdamW under tensor parallel: each worker steps its own shards. Gradients are averaged over the data-parallel
group (`tp_workers.TensorParallelWorkers`), clipped by NxD's `clip_grad_norm` (a sharded parameter's norm
counted once over the tensor-parallel group, a replicated one once), then stepped as in a replicated run.

Checkpoints are NxD's per-rank layout, as `checkpoint migrate --to neuron` writes it (`parallel/nxd_layout.py`):
data-parallel rank 0 of each tensor-parallel rank writes model/ and optim/ dp_rank_00_tp_rank_TT_pp_rank_00.pt,
worker 0 the sharding spec and config.json beside them, so a checkpoint directory is also a checkpoint that
`migrate --to gpu`, `inspect` and `run --init-from` read. state.pt keeps what is the same on every rank (the
schedule, AdamW's hyper-parameters, the data position, the RNG) and worker 0's own shards under "model",
which a resumed run replaces with each rank's file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from neurontrain.backends import Backend
from neurontrain.errors import UsageError
from neurontrain.loop import steps
from neurontrain.loop.strategies.replicated import Replicated
from neurontrain.loop.tp_workers import TensorParallelWorkers
from neurontrain.parallel.nxd_layout import (
    MODEL_DIR,
    MOMENTS,
    OPTIM_DIR,
    SPEC_FILE,
    fuse_moments,
    fuse_rank,
    rank_file,
    unfuse_moments,
    unfuse_rank,
)
from neurontrain.parallel.tensor_parallel import model_spec
from neurontrain.plan.planning import RunPlan

TP_DEGREE = "tensor_parallel"  # a TP checkpoint's optimizer entry: {TP_DEGREE: tp, "param_groups": ...}


def nxd_clip(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    from neuronx_distributed.parallel_layers import grads  # lazy: installed on Neuron hosts only

    return grads.clip_grad_norm(list(params), max_norm)


class TensorParallelAdamW(Replicated):
    """Replicated AdamW over this rank's shards, with NxD's clipping and NxD's checkpoint layout."""

    def __init__(self, plan: RunPlan, model: torch.nn.Module, backend: Backend, dp: TensorParallelWorkers) -> None:
        if plan.recipe.train.zero1 is True:
            raise UsageError(f"train.zero1 with parallel.tp: {dp.tp} is not supported yet (set train.zero1: false)")
        super().__init__(plan.recipe, model, backend, dp, plan.host_reduce)
        self.model, self.tp = model, dp.tp
        self.spec = model_spec(model, dp.tp)
        self.by_name = dict(model.named_parameters())

    def step(self, micro_losses: list[torch.Tensor], items: int) -> tuple[float | torch.Tensor | None, float]:
        loss = self.dp.reduce_step(self.params, micro_losses, items, self.backend, host=self.host)
        return loss, steps.optimizer_step(self.params, self.optimizer, self.scheduler, self.recipe, clip=nxd_clip)

    def device_step(self) -> None:
        steps.optimizer_step(self.params, self.optimizer, self.scheduler, self.recipe, clip=nxd_clip)

    def state_dict(self) -> dict:
        return {TP_DEGREE: self.tp, "param_groups": self.optimizer.state_dict()["param_groups"]}

    def rank_state(self) -> dict[str, Any]:
        """The files this worker writes into a checkpoint (relative path -> content)."""
        dp, spec, names = self.dp, self.spec, list(self.spec.names)
        if dp.rank != 0:
            return {}  # the other data-parallel ranks hold the same shards
        states = [self.optimizer.state[self.by_name[n]] for n in names]
        host = self.backend.to_host([self.by_name[n].detach() for n in names] + [s[k] for s in states for k in MOMENTS])
        weights, rest = dict(zip(names, host)), host[len(names) :]
        moments = {n: dict(zip(MOMENTS, rest[2 * i : 2 * i + 2])) for i, n in enumerate(names)}
        steps_of = {n: torch.as_tensor(s["step"]).detach().cpu().clone() for n, s in zip(names, states)}
        name = rank_file(dp.tp_rank, 0)
        files: dict[str, Any] = {
            f"{MODEL_DIR}/{name}": fuse_rank(spec, names, lambda n, rule: weights[n]),
            f"{OPTIM_DIR}/{name}": fuse_moments(spec, names, lambda n, rule, k: moments[n][k], steps_of.__getitem__),
        }
        if dp.is_master:
            files[SPEC_FILE] = spec.to_json()
            files["config.json"] = self.model.config.to_dict()
        return files

    def load(self, saved: dict, scheduler: dict, checkpoint: Path | None) -> None:
        """Resume: this rank's shards and AdamW state from its own files in the checkpoint."""
        if checkpoint is None or saved.get(TP_DEGREE) != self.tp:
            raise UsageError(
                f"checkpoint {checkpoint} was not written by a run at parallel.tp: {self.tp}; use another "
                "--output-dir or set checkpoint.resume=false"
            )
        names, name = list(self.spec.names), rank_file(self.dp.tp_rank, 0)
        weights = unfuse_rank(self.spec, names, torch.load(checkpoint / MODEL_DIR / name, map_location="cpu"))
        moments = unfuse_moments(self.spec, names, torch.load(checkpoint / OPTIM_DIR / name, map_location="cpu"))
        for param, value in zip((self.by_name[n] for n in names), self.backend.to_device([weights[n] for n in names])):
            param.data = value
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        state = {index[id(self.by_name[n])]: moments[n] for n in names}
        self.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
        self.scheduler.load_state_dict(scheduler)
