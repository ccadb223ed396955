"""ZeRO-1: each data-parallel worker keeps AdamW's state and an fp32 master copy for its chunk of every
parameter only (torch-xla's `ZeroRedundancyOptimizer` layout, `parallel/zero_layout.py`).

Two implementations of `Strategy` (subclasses of `Replicated`; `select.py` picks one):

- `HostZero1`, where gradients are reduced on the host (XLA:CPU workers, whose xla process group is a world of
  one): after the micro-step graphs, the gradients leave the device, are weighted and reduce-scattered over
  gloo (each worker receives the item-weighted mean of its chunks only), clipped by the global norm (the
  chunks' squared norms summed over the workers), and come back as device data: the optimizer graph steps
  AdamW on the chunks. After its sync the updated chunks are all-gathered over gloo into full parameters,
  which return as device data (no graph).
- `InGraphZero1` on Neuron: NxD's `NeuronZero1Optimizer` when neuronx-distributed is installed, torch-xla's
  `ZeroRedundancyOptimizer` otherwise, with its reduce-scatter and all-gather inside the step graph. Written
  to their documented interfaces; untested here (XLA:CPU workers cannot form an xla process group).

Checkpoints hold each rank's state dict in torch-xla's format (`parallel/zero1_state.py`), one file per rank;
a run at another world size (or a replicated run) consolidates them and cuts its own chunks.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

from neurontrain.backends import Backend
from neurontrain.errors import UsageError
from neurontrain.loop import steps
from neurontrain.loop.checkpoints import load_rank_files
from neurontrain.loop.dataparallel import DataParallel, global_loss, loss_stats
from neurontrain.loop.optim import (
    ZERO1_WORLD,
    build_adamw,
    build_optimizer,
    build_scheduler,
    device_bytes,
    materialize_optimizer_state,
    moment_tensors,
)
from neurontrain.loop.strategies.replicated import Replicated
from neurontrain.parallel.zero1_state import chunk, consolidate, rank_state, unchunk
from neurontrain.recipe import Recipe


def _trainable(model: torch.nn.Module) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    if any(p.dim() == 0 for p in params):
        raise UsageError("train.zero1 shards parameters on dim 0; this model has a scalar parameter")
    return params


def _zero_full_grads(params: list[torch.Tensor]) -> None:
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)


def _digest(host: list[torch.Tensor]) -> str:
    sha = hashlib.sha256()
    for tensor in host:
        sha.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:16]


def _chunk_norm_clip(grads: list[torch.Tensor], max_norm: float, dp: DataParallel) -> None:
    """torch.nn.utils.clip_grad_norm_'s rule over the full gradient: the chunks' squared norms (padding is
    zeros) summed over the workers, then every chunk scaled by max_norm / (norm + 1e-6) where that is below 1."""
    squares = torch.tensor([sum(float(g.to(torch.float64).pow(2).sum()) for g in grads)], dtype=torch.float64)
    norm = math.sqrt(float(dp.all_reduce_host(squares)[0]))
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)


class HostZero1(Replicated):
    """ZeRO-1 through gloo on host copies (see the module docstring)."""

    def __init__(self, recipe: Recipe, model: torch.nn.Module, backend: Backend, dp: DataParallel) -> None:
        self.recipe, self.backend, self.dp = recipe, backend, dp
        self.params = _trainable(model)
        host = backend.to_host([p.detach() for p in self.params])
        chunks = backend.to_device([chunk(h.to(torch.float32), dp.world, dp.rank) for h in host])
        self.chunks = [torch.nn.Parameter(c) for c in chunks]  # model order
        self.optimizer = build_adamw(recipe, self.chunks)
        self.scheduler = build_scheduler(recipe, self.optimizer)
        index = {id(c): i for i, c in enumerate(self.chunks)}
        self.order = [index[id(c)] for group in self.optimizer.param_groups for c in group["params"]]

    def materialize(self) -> None:
        _zero_full_grads(self.params)
        materialize_optimizer_state(self.optimizer, grads=False)

    def step(self, micro_losses: list[torch.Tensor], items: int) -> tuple[float, float]:
        """Reduce-scatter, clip, then AdamW on this worker's chunks (the optimizer graph, pending)."""
        world, stats = self.dp.world, loss_stats(micro_losses, items, self.backend)
        grads = self.backend.to_host([p.grad for p in self.params])
        chunks = self.dp.reduce_scatter_on_host(grads, lambda g, r: chunk(g, world, r), stats)
        if self.recipe.train.max_grad_norm is not None:
            _chunk_norm_clip(chunks, self.recipe.train.max_grad_norm, self.dp)
        return global_loss(stats), self.optimizer_graph(chunks)

    def optimizer_graph(self, grads: list[torch.Tensor]) -> float:
        """The chunks' gradients (host, model order) in as device data, then the pending optimizer graph."""
        for param, grad in zip(self.chunks, self.backend.to_device(grads)):
            param.grad = grad
        return steps.sharded_optimizer_step(self.params, self.optimizer, self.scheduler)

    def device_step(self) -> None:
        self.optimizer_graph([torch.zeros(c.shape, dtype=c.dtype) for c in self.chunks])

    def after_sync(self) -> None:
        """All-gather the updated chunks into full parameters, back on the device as data."""
        host = self.backend.to_host([c.detach() for c in self.chunks])
        rows = self.dp.all_gather_host(torch.cat([h.reshape(-1) for h in host]))
        sizes = [h.numel() for h in host]
        by_rank = [row.split(sizes) for row in rows]
        full = [
            unchunk([by_rank[r][i].view(h.shape) for r in range(self.dp.world)], p.shape[0]).to(p.dtype)
            for i, (h, p) in enumerate(zip(host, self.params))
        ]
        for param, value in zip(self.params, self.backend.to_device(full)):
            param.data = value

    def state_dict(self) -> dict:
        return {ZERO1_WORLD: self.dp.world}

    def rank_state(self) -> tuple[int, dict]:
        """(rank, this rank's state dict in torch-xla's ZeroRedundancyOptimizer format, on the host)."""
        base = self.optimizer.state_dict()
        state = {i: dict(s) for i, s in base["state"].items()}  # state_dict() shares the live per-parameter dicts
        keys = [(i, k) for i, s in state.items() for k, v in s.items() if v.dim()]
        host = self.backend.to_host([state[i][k] for i, k in keys] + [self.chunks[j].detach() for j in self.order])
        for (i, k), value in zip(keys, host):
            state[i][k] = value
        masters = host[len(keys) :]
        return self.dp.rank, {
            "state": {},
            "param_groups": base["param_groups"],
            "base_state": state,
            "shape_info": {i: self.params[j].shape for i, j in enumerate(self.order)},
            "sharded_master_weights": dict(enumerate(masters)),
            "dp_rank": self.dp.rank,
            "tp_rank": 0,
        }

    def parameter_digest(self) -> str:
        """A hash of the full parameters this worker holds (every worker's must be the same)."""
        return _digest(self.backend.to_host([p.detach() for p in self.params]))

    def optimizer_parameters(self) -> list[torch.Tensor]:
        """The full parameters in the numbering of the state dict (that of the chunks' optimizer)."""
        return [self.params[j] for j in self.order]

    def load(self, saved: dict, scheduler: dict | None, checkpoint: Path | None) -> None:
        """This rank's file when the checkpoint was written by a world of this size; else every rank's file
        (or a plain state dict: a replicated run's, or `run --init-from`'s) consolidated and cut for this
        world."""
        world, rank = self.dp.world, self.dp.rank
        saved_world = saved.get(ZERO1_WORLD)
        if saved_world == world:
            mine = load_rank_files(checkpoint, [rank])[0]
        else:
            if saved_world:
                plain, masters = consolidate(load_rank_files(checkpoint, list(range(saved_world))))
            else:
                plain, masters = saved, self.backend.to_host([self.params[j].detach() for j in self.order])
            shapes = [self.params[j].shape for j in self.order]
            mine = rank_state(plain, shapes, masters, world, rank)
        self.optimizer.load_state_dict({"state": mine["base_state"], "param_groups": mine["param_groups"]})
        masters = self.backend.to_device([mine["sharded_master_weights"][i] for i in range(len(self.order))])
        for j, value in zip(self.order, masters):
            self.chunks[j].data = value
        if scheduler is not None:
            self.scheduler.load_state_dict(scheduler)

    def memory(self, model: torch.nn.Module) -> dict[str, int]:
        return device_bytes(model, self.backend.device, moment_tensors(self.optimizer), masters=self.chunks)


class InGraphZero1(Replicated):
    """Neuron: NxD's NeuronZero1Optimizer (or torch-xla's ZeroRedundancyOptimizer without NxD), its
    reduce-scatter, clipping and all-gather inside the step graph. Untested here."""

    def __init__(self, recipe: Recipe, model: torch.nn.Module, backend: Backend, dp: DataParallel) -> None:
        self.recipe, self.backend, self.dp = recipe, backend, dp
        self.params = _trainable(model)
        spec, clip = recipe.train.optimizer, recipe.train.max_grad_norm
        groups = [
            {"params": g["params"], "weight_decay": g["weight_decay"]}
            for g in build_optimizer(recipe, model).param_groups
        ]
        options = dict(
            optimizer_class=torch.optim.AdamW,
            optimizer_dtype=torch.float32,
            grad_clipping=clip is not None,
            max_norm=clip,
            pin_layout=False,
            save_master_weights=True,
            lr=spec.lr,
            betas=spec.betas,
            eps=spec.eps,
        )
        try:
            from neuronx_distributed.optimizer import NeuronZero1Optimizer  # lazy: present on Neuron hosts only
            from neuronx_distributed.parallel_layers import parallel_state  # lazy: as above

            if not parallel_state.model_parallel_is_initialized():
                parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
            self.optimizer = NeuronZero1Optimizer(groups, **options)
        except ImportError:
            from torch_xla.distributed.zero_redundancy_optimizer import (  # lazy: importing torch_xla starts a runtime
                ZeroRedundancyOptimizer,
            )

            self.optimizer = ZeroRedundancyOptimizer(groups, **options)
        self.scheduler = build_scheduler(recipe, self.optimizer)

    def materialize(self) -> None:
        _zero_full_grads(self.params)
        materialize_optimizer_state(self.optimizer.base_optimizer, grads=False)

    def state_tensors(self, model: torch.nn.Module) -> list[torch.Tensor]:
        return steps.state_tensors(model, self.optimizer.base_optimizer)

    def step(self, micro_losses: list[torch.Tensor], items: int) -> tuple[torch.Tensor, float]:
        """Scale each worker's gradients so that the optimizer's mean reduce-scatter gives the item-weighted
        mean (`DataParallel`'s semantics), then its step: reduce-scatter, clip, AdamW, all-gather."""
        import torch_xla.core.xla_model as xm  # lazy: importing torch_xla starts a runtime

        device = self.backend.device
        weight = torch.tensor(float(items)).to(device)
        total = xm.all_reduce(xm.REDUCE_SUM, weight.clone()).clamp(min=1.0)
        for param in self.params:
            param.grad.mul_(weight * self.dp.world / total)
        mean = torch.stack(micro_losses).mean() if micro_losses else torch.zeros((), device=device)
        lr = self.optimizer.param_groups[0]["lr"]
        self.device_step()
        return xm.all_reduce(xm.REDUCE_SUM, mean * weight) / total, lr

    def device_step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=False)

    def state_dict(self) -> dict:
        return {ZERO1_WORLD: self.dp.world}

    def rank_state(self) -> tuple[int, dict]:
        state = self.optimizer.state_dict()
        return self.dp.rank, {
            **tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, state),
            "dp_rank": self.dp.rank,
            "tp_rank": 0,
        }

    def load(self, saved: dict, scheduler: dict | None, checkpoint: Path | None) -> None:
        world, rank = self.dp.world, self.dp.rank
        saved_world = saved.get(ZERO1_WORLD)
        if saved_world == world:
            mine = load_rank_files(checkpoint, [rank])[0]
        else:
            plain, masters = (
                consolidate(load_rank_files(checkpoint, list(range(saved_world))))
                if saved_world
                else (saved, [p.detach().cpu() for g in self.optimizer.param_groups for p in g["params"]])
            )
            shapes = [p.shape for g in self.optimizer.param_groups for p in g["params"]]
            mine = rank_state(plain, shapes, masters, world, rank)
        self.optimizer.load_state_dict(mine)
        if scheduler is not None:
            self.scheduler.load_state_dict(scheduler)

    def memory(self, model: torch.nn.Module) -> dict[str, int]:
        base = self.optimizer.base_optimizer
        shards = [p for g in base.param_groups for p in g["params"]]
        return device_bytes(model, self.backend.device, moment_tensors(base), masters=shards)
