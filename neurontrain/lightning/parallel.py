"""Data parallel for Lightning under torchrun: each worker trains its share of every global batch on its own PJRT
device, with the toolkit's data-parallel layer (`loop/dataparallel.py`) for everything between the workers.

On XLA:CPU each torchrun worker's runtime is a world of one, so gradients are averaged on the host over gloo
(on Neuron the same weighted mean is an xm.all_reduce inside the optimizer graph: written, not run here),
as `neurontrain run` does there: after the last micro-batch's backward (its graph cut by the sync the strategy
places there), every gradient leaves the device in one transfer, is weighted by the worker's loss items (labels
other than the ignore index, else rows) and all-reduced, and comes back as device data; clipping and the
optimizer then run in the optimizer graph on every worker alike. The gradient is thus that of the mean loss over
every loss item of the global batch, provided the user's loss is a mean over its items (as cross_entropy with
ignore_index is). Lightning's DistributedSampler splits each loader by rank (`distributed_sampler_kwargs`),
so a worker of N rows sees rows r, r + world, ... of the global batch of N x world.

Lightning's own collectives (ModelCheckpoint's shared directory and decisions, `all_gather`, `sync_dist`)
run on host values over the same gloo group: none of them adds a graph. The buckets are rank 0's choice, sent
to every worker, so all workers pad to the same shapes.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy

from neurontrain.lightning import runtime
from neurontrain.lightning.session import Session
from neurontrain.lightning.strategy import NeurontrainStrategy, PJRTAccelerator
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.plan.planning import reduces_on_host

IGNORE_KEY = "labels"


def under_torchrun() -> bool:
    """Whether torchrun (or another launcher with its environment) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ


def loss_items(batch: Any, ignore: int | float) -> int:
    """A padded batch's loss items: its `labels` other than the ignore value, else its rows."""
    labels = batch.get(IGNORE_KEY) if hasattr(batch, "get") else None
    if isinstance(labels, torch.Tensor):
        return int((labels != ignore).sum()) if labels.dim() >= 2 else int(labels.shape[0])
    first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None) if hasattr(batch, "values") else None
    return int(first.shape[0]) if first is not None and first.dim() else 0


def _is_mean(reduce_op: Any) -> bool:
    """ "mean", "avg", ReduceOp.AVG: a mean; "sum", ReduceOp.SUM: a sum."""
    return not str(reduce_op).lower().endswith("sum")


class NeurontrainDataParallelStrategy(NeurontrainStrategy, ParallelStrategy):
    """The single-device strategy's syncs, padding and guard on each torchrun worker, plus the host all-reduce
    of the gradients and Lightning's collectives over gloo."""

    strategy_name = "neurontrain_ddp"

    def __init__(self, session: Session, accelerator: PJRTAccelerator, dp: DataParallel, timeout: float) -> None:
        super().__init__(session, accelerator)
        self.dp, self.timeout = dp, timeout
        self.window_items = 0  # loss items of this worker's micro-batches since the last optimizer step
        self.window_start = 0  # where this window's losses start in the session's
        self.in_step = False  # inside training_step / validation_step: a reduce there is a logged step value
        self.step_values: list[tuple[torch.Tensor, Any]] = []  # (value, reduce op) logged with sync_dist this step

    # -- where this worker stands ----------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        return True

    # Lightning's single-device __init__ assigns a world of one to these; the group's own values win.
    @property
    def global_rank(self) -> int:
        return self.dp.rank

    @global_rank.setter
    def global_rank(self, _: int) -> None:
        pass

    @property
    def local_rank(self) -> int:
        return self.dp.local_rank

    @local_rank.setter
    def local_rank(self, _: int) -> None:
        pass

    @property
    def world_size(self) -> int:
        return self.dp.world

    @world_size.setter
    def world_size(self, _: int) -> None:
        pass

    @property
    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", 0))

    @property
    def is_global_zero(self) -> bool:
        return self.dp.is_master

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.dp.world, "rank": self.dp.rank}

    def setup_environment(self) -> None:
        """The process group first: the preflight (with the collective checks) and everything after talk to the
        other workers."""
        self.dp.start(self.session.backend, self.timeout)
        self.callback.dp = self.dp
        super().setup_environment()

    def agreed_plan(self, plan: tuple) -> tuple:
        return self.broadcast(plan, 0)

    def teardown(self) -> None:
        super().teardown()
        self.dp.close()

    # -- Lightning's collectives, on host values -------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        self.dp.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.dp.enabled:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src, group=self.dp.host_group)
        return holder[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Sum (or mean) over the workers of a tensor's host value; anything else unchanged. A value logged with
        `sync_dist=True` inside a step is reduced after the step's sync instead, with the step's other such values
        (`reduce_step_values`): read here, it would launch the step's graph so far, a hidden host sync per key."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if self.in_step and tensor.device.type == "xla":
            self.step_values.append((tensor, reduce_op))
            return tensor
        if tensor.device.type == "xla":  # an epoch's state (Lightning reduces a clone): the data it refers to
            data = runtime.as_data(tensor)
            tensor = self.session.backend.to_host([data if data is not None else tensor])[0]
        total = self.dp.all_reduce_host(tensor.detach().clone().to(torch.float64))
        return (total / self.dp.world if _is_mean(reduce_op) else total).to(tensor.dtype)

    def reduce_step_values(self) -> None:
        """The step's `sync_dist` values (computed by now) read in one transfer, reduced over the workers in one
        collective, and written back in place (host data: Lightning's later reads of them read no device)."""
        values, self.step_values = self.step_values, []
        if not values:
            return
        host = self.session.backend.to_host([t for t, _ in values])
        total = self.dp.all_reduce_host(torch.stack([h.detach().reshape(()).to(torch.float64) for h in host]))
        for (tensor, op), h, reduced in zip(values, host, total):
            with torch.no_grad():
                tensor.copy_((reduced / self.dp.world if _is_mean(op) else reduced).to(h.dtype).reshape(h.shape))

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.in_step = True
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self.in_step = False

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super().backward(closure_loss, optimizer, *args, **kwargs)  # its sync computed the step's values
        self.reduce_step_values()
        return out

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.in_step = True
        try:
            out = super().validation_step(*args, **kwargs)
        finally:
            self.in_step = False
        self.reduce_step_values()
        return out

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        votes = int(self.dp.all_reduce_host(torch.tensor([float(bool(decision))], dtype=torch.float64))[0])
        return votes == self.dp.world if all else votes > 0

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        host = self.session.backend.to_host([tensor])[0] if tensor.device.type == "xla" else tensor
        return torch.stack(self.dp.all_gather_object(host.detach()))

    # -- the gradient --------------------------------------------------------------------------------------
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        moved = super().batch_to_device(batch, device, dataloader_idx)
        if self.lightning_module is not None and self.lightning_module.trainer.training and hasattr(batch, "keys"):
            padding = self.session.padding
            self.window_items += loss_items(batch, padding.value(IGNORE_KEY) if padding else -100)
        return moved

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The last micro-batch (the closure), then the gradients averaged over the workers, then Lightning's
        clipping and the optimizer."""

        def closure_then_reduce() -> Any:
            out = closure()
            self.reduce_gradients()
            return out

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    def reduce_gradients(self) -> None:
        """The gradients averaged over the workers, weighted by their loss items: on the host where the workers'
        runtimes cannot reduce together (XLA:CPU), else inside the optimizer graph."""
        session = self.session
        params = [p for p in self.lightning_module.parameters() if p.grad is not None]
        losses = session.losses[self.window_start :]
        self.window_start = len(session.losses)
        if reduces_on_host(session.backend.name):
            self._reduce_on_host(params, losses)
            return
        # Neuron: xm.all_reduce of the weighted gradients and the loss, traced into the graph the optimizer
        # step's sync cuts (the toolkit's in-graph reduction, as `run` does there). Not runnable on XLA:CPU.
        step_loss = self.dp.reduce_step(params, losses, self.window_items, session.backend, host=False)
        self.window_items = 0
        session.device_step_losses.append(step_loss)

    def _reduce_on_host(self, params: list[torch.Tensor], losses: list[torch.Tensor]) -> None:
        """The gradients and this window's losses read in one transfer; the gradients averaged, and the step's
        global loss (the item-weighted mean of the workers' losses) kept for the summary."""
        session = self.session
        host = session.backend.to_host([p.grad for p in params] + losses)
        grads, local = host[: len(params)], host[len(params) :]
        mean = sum(float(v) for v in local) / len(local) if local else 0.0
        stats = torch.tensor([mean * self.window_items, float(self.window_items)], dtype=torch.float64)
        self.window_items = 0
        stats = self.dp.reduce_on_host(params, session.backend, stats, host=grads)
        session.step_losses.append(float(stats[0] / stats[1]) if float(stats[1]) > 0 else float("nan"))
