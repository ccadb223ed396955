"""A worker's place in a tensor-parallel run: NxD's model parallel state, and the data-parallel view of the
workers that the trainer sees.

NxD lays the workers out as ranks reshaped to [DP, TP] (tensor-parallel ranks contiguous; on trn1 TP 4
its own interleaving), and `initialize_model_parallel` makes the groups; this module takes the groups from
NxD (`get_data_parallel_replica_groups`) rather than computing them. Under TP the trainer's `DataParallel`
is the data-parallel group: `rank` and `world` are the data-parallel rank and size (the batch is split over
those only; the TP ranks of one group read the same rows), gradients and loss statistics are averaged over
it (in the graph with NxD's replica groups, or on the host over a gloo group per data-parallel group),
barriers span every worker, and worker 0 of the whole job writes the run's files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from neurontrain.errors import UsageError
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.parallel.native_tp import device_mesh
from neurontrain.parallel.tensor_parallel import require_nxd


@dataclass
class TensorParallelWorkers(DataParallel):
    """The data-parallel group of this worker (rank, world), seen from a tensor-parallel run."""

    tp: int = 1
    tp_rank: int = 0
    global_rank: int = 0
    _world_group: Any = None  # gloo over every worker (barriers)
    mesh: Any = None  # native backend: the [dp, tp] DeviceMesh (`parallel/native_tp.py`)

    @property
    def is_master(self) -> bool:
        return self.global_rank == 0

    @property
    def world_group(self) -> Any:
        """The gloo group over every worker (None: the default group, which is gloo)."""
        return self._world_group

    def barrier(self) -> None:
        dist.barrier(group=self._world_group)


def join_tensor_parallel(workers: DataParallel, tp: int) -> TensorParallelWorkers:
    """After the process group is up: NxD's model parallel state at degree `tp` (every worker calls this), and
    this worker's data-parallel view with a gloo group for host collectives over its data-parallel group."""
    require_nxd(tp)
    from neuronx_distributed.parallel_layers import parallel_state  # lazy: installed on Neuron hosts only

    if not workers.enabled or workers.world % tp:
        raise UsageError(f"parallel.tp: {tp} needs a multiple of {tp} workers (this run has {workers.world})")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    groups = [list(map(int, g)) for g in parallel_state.get_data_parallel_replica_groups()]
    mine = _gloo_group_of(groups, workers.rank)
    return TensorParallelWorkers(
        rank=parallel_state.get_data_parallel_rank(),
        world=parallel_state.get_data_parallel_size(),
        local_rank=workers.local_rank,
        restart=workers.restart,
        replica_groups=groups,
        _group=mine,
        tp=tp,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        global_rank=workers.rank,
        _world_group=workers._group,
    )


def _gloo_group_of(groups: list[list[int]], rank: int) -> Any:
    """A gloo group for each rank list (every worker creates every group, in the same order); `rank`'s own."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = group
    return mine


def join_native_mesh(workers: DataParallel, tp: int, device_type: str) -> TensorParallelWorkers:
    """The native backend's tensor parallel: a [dp, tp] DeviceMesh over every worker (TP ranks contiguous, as
    NxD lays them out), and this worker's data-parallel view with a gloo group per data-parallel group."""
    if not workers.enabled or workers.world % tp:
        raise UsageError(f"parallel.tp: {tp} needs a multiple of {tp} workers (this run has {workers.world})")
    dp = workers.world // tp
    mesh = device_mesh(device_type, dp, tp)
    groups = [[t + tp * d for d in range(dp)] for t in range(tp)]
    mine = _gloo_group_of(groups, workers.rank)
    return TensorParallelWorkers(
        rank=workers.rank // tp,
        world=dp,
        local_rank=workers.local_rank,
        restart=workers.restart,
        replica_groups=groups,
        _group=mine,
        tp=tp,
        tp_rank=workers.rank % tp,
        global_rank=workers.rank,
        _world_group=workers._group,
        mesh=mesh,
    )
