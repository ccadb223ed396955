"""The worker's side of data parallelism: process group, gradient reduction, barriers, rank-0-only writes.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; `DataParallel.from_env()` reads
them (a plain `neurontrain run` is a world of one and touches no process group).

Gradients of a step are averaged over every label the step saw, on all workers together: each worker's
gradient is weighted by its number of loss items (tokens for causal LM, samples for classification), so the
result is the gradient of the mean loss over the global batch, whatever the split of padding between workers.
With train.grad_accum > 1 a worker's own gradient stays the mean of its micro-batch means (as in a one-worker
run) before that weighting.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from neurontrain.backends import Backend


@dataclass
class DataParallel:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    restart: int = 0  # TORCHELASTIC_RESTART_COUNT: how often torchrun restarted this group
    replica_groups: list[list[int]] | None = None  # in-graph all-reduces over these groups (None: all workers)
    _group: Any = None  # gloo group for host tensors and objects
    _store: Any = None  # the job's key-value store (torchrun's), apart from the collectives
    _started: bool = False

    @classmethod
    def from_env(cls) -> DataParallel:
        env = os.environ
        return cls(
            int(env.get("RANK", 0)),
            int(env.get("WORLD_SIZE", 1)),
            int(env.get("LOCAL_RANK", 0)),
            int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def host_group(self) -> Any:
        """The gloo group for host tensors and objects (None: the default group, which is gloo)."""
        return self._group

    def start(self, backend: Backend, timeout_s: float) -> None:
        """Join the process group: gloo for host tensors on every backend; Neuron and XLA:CUDA also the xla
        backend for the in-graph gradient all-reduce."""
        if self._started:
            return
        timeout = timedelta(seconds=timeout_s)
        if not self.enabled:
            target = getattr(backend, "target", None)
            if target is not None and target.process_group_first:  # TorchNeuron: its group assigns the cores
                dist.init_process_group(backend.process_group, store=dist.HashStore(), rank=0, world_size=1)
                self._started = True
            return
        if backend.collectives == "xla":
            import torch_xla.distributed.xla_backend  # noqa: F401  # lazy: starts a runtime; registers "xla"

            dist.init_process_group("xla", init_method="xla://", timeout=timeout)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        else:
            # torchrun's workers share the agent's store across restarts, and env:// adds no per-attempt prefix:
            # a restarted group could read the dead workers' gloo addresses (seen here as "connection
            # refused" after a SIGKILL). Key this attempt's rendezvous by the restart count.
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            store = dist.PrefixStore(f"neurontrain/attempt_{self.restart}", store)
            self._store = store
            # native: the device's own process group (gloo on the CPU, `neuron` on TorchNeuron) for DDP
            collectives = backend.process_group
            dist.init_process_group(collectives, store=store, rank=rank, world_size=world, timeout=timeout)
            # host tensors and objects go through gloo: the default group when it is gloo, else a gloo group
            self._group = None if collectives == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        self._started = True

    def store(self) -> Any:
        """The job's key-value store behind the process group (torchrun's TCPStore): bounded waits beside the
        collectives (`loop/rank_check.py`)."""
        return self._store if self._store is not None else dist.distributed_c10d._get_default_store()

    def close(self) -> None:
        """Leave the process group so that its threads end here, while Python is fully alive. What still holds
        the group (DDP's reducer, FSDP2's mesh, in reference cycles with the trainer) is collected first, so
        destroy_process_group frees the group and joins its gloo worker threads now; left to interpreter
        shutdown, a worker thread that drops a tensor's Python object aborts the process ("terminate called
        without an active exception")."""
        if self._started:
            self._group = None
            gc.collect()
            dist.destroy_process_group()
            self._started = False

    # -- host-side collectives -------------------------------------------------------------------------
    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self._group)

    def all_reduce_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a CPU tensor over workers, in place."""
        if self.enabled:
            dist.all_reduce(tensor, group=self._group)
        return tensor

    def sum_counts(self, real: int, slots: int) -> tuple[int, int]:
        """Token counts (real, slots) summed over the workers."""
        if not self.enabled:
            return real, slots
        counts = self.all_reduce_host(torch.tensor([real, slots], dtype=torch.float64))
        return int(counts[0]), int(counts[1])

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self._group)
        return out

    # -- gradients ------------------------------------------------------------------------------------------
    def reduce_step(
        self, params: list[torch.Tensor], micro_losses: list[torch.Tensor], items: int, backend: Backend, *, host: bool
    ) -> float | torch.Tensor | None:
        """Average a step's gradients over all workers, on the host (`host`: after the micro-step sync) or in the
        graph. Returns the global loss (a host float after a host reduction, a device scalar after an in-graph
        one), or None with one worker. items: the loss items of this worker's micro-batches."""
        if not self.enabled:
            return None
        if host:
            stats = self.reduce_on_host(params, backend, loss_stats(micro_losses, items, backend))
            return global_loss(stats)
        import torch_xla.core.xla_model as xm  # lazy: importing torch_xla starts a runtime

        device = backend.device
        weight = torch.tensor(float(items)).to(device)
        mean = torch.stack(micro_losses).mean() if micro_losses else torch.zeros((), device=device)
        total = self.reduce_in_graph(params, weight)
        return xm.all_reduce(xm.REDUCE_SUM, mean * weight, groups=self.replica_groups) / total.clamp(min=1.0)

    def reduce_on_host(
        self, params: list[torch.Tensor], backend: Backend, stats: torch.Tensor, host: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """After the micro-step sync: weighted all-reduce of the gradients through host copies, written back
        as device data (the optimizer graph's inputs). stats = [loss x items, items, ...] (float64) is summed
        in the same round; returns it. host: the gradients' host copies when the caller has read them already."""
        grads = [p.grad for p in params]
        host = host if host is not None else backend.to_host(grads)
        items = float(stats[1])
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in host])
        if items > 0:
            flat.mul_(items)
        else:
            flat.zero_()  # a worker without labels this step (partial last batch): no weight, no NaN
        self.all_reduce_host(flat)
        self.all_reduce_host(stats)
        flat.div_(max(float(stats[1]), 1.0))
        chunks = [c.view_as(g).to(g.dtype) for c, g in zip(flat.split([g.numel() for g in host]), host)]
        for param, grad in zip(params, backend.to_device(chunks)):
            param.grad = grad
        return stats

    def reduce_scatter_on_host(
        self, grads: list[torch.Tensor], chunk: Callable[[torch.Tensor, int], torch.Tensor], stats: torch.Tensor
    ) -> list[torch.Tensor]:
        """ZeRO-1: the weighted mean of the gradients as `reduce_on_host` makes it, of which this worker receives
        only its chunks (`chunk(grad, rank)`, fp32), through a reduce-scatter. `grads` are host copies; stats as
        for reduce_on_host, summed in the same round."""
        items = float(stats[1])
        by_rank = [[chunk(g, r).to(torch.float32) for g in grads] for r in range(self.world)]
        shapes = [c.shape for c in by_rank[0]]  # every rank's chunks have the same shapes
        send = torch.cat([c.reshape(-1) for chunks in by_rank for c in chunks])
        if items > 0:
            send.mul_(items)
        else:
            send.zero_()  # a worker without labels this step (partial last batch): no weight, no NaN
        received = torch.empty(send.numel() // self.world, dtype=torch.float32)
        dist.reduce_scatter_tensor(received, send, group=self._group)
        self.all_reduce_host(stats)
        received.div_(max(float(stats[1]), 1.0))
        return [c.view(shape) for c, shape in zip(received.split([math.prod(x) for x in shapes]), shapes)]

    def all_gather_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every worker's 1-D `tensor` (all the same length), in rank order: a (world, len) tensor."""
        out = torch.empty(self.world * tensor.numel(), dtype=tensor.dtype)
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=self._group)
        return out.view(self.world, -1)

    def reduce_in_graph(self, params: list[torch.Tensor], items: torch.Tensor) -> torch.Tensor:
        """Neuron / XLA:CUDA: the same weighted mean, as all-reduces inside the step's graph (xm.all_reduce,
        what xm.optimizer_step does, plus the weights). `items` is this worker's loss-item count on the device;
        returns the global count. Written to torch-xla's API; not runnable on XLA:CPU, where torchrun workers
        cannot form an xla process group."""
        import torch_xla.core.xla_model as xm  # lazy: importing torch_xla starts a runtime

        grads = [p.grad for p in params]
        total = xm.all_reduce(xm.REDUCE_SUM, items.clone(), groups=self.replica_groups)
        scaled = [g * items for g in grads]
        xm.all_reduce(xm.REDUCE_SUM, scaled, groups=self.replica_groups)
        for g, s in zip(grads, scaled):
            g.copy_(s / total.clamp(min=1.0))
        return total


def loss_stats(micro_losses: list[torch.Tensor], items: int, backend: Backend) -> torch.Tensor:
    """[loss x items, items] (float64) of this worker's step, its loss the mean of its micro-batch losses (read
    after the micro-step sync)."""
    local = backend.to_host(micro_losses) if micro_losses else []
    mean = sum(float(x) for x in local) / len(local) if local else 0.0
    return torch.tensor([mean * items, items], dtype=torch.float64)


def global_loss(stats: torch.Tensor) -> float:
    """The step's loss over all workers from summed loss stats."""
    return float(stats[0] / max(float(stats[1]), 1.0))
