"""A process group that stands for a whole layout of workers inside one process, for `precompile --backend native
--nproc-per-node N`: this process is one rank of N, and every collective returns at once as if each peer were this
rank's twin (an all-gather repeats this rank's input, a reduce-scatter hands back this rank's chunk, an all-reduce
and a broadcast leave the tensor as it is). As PyTorch's own `FakeProcessGroup` for its tests, but a Python process
group, so it serves any device type (TorchNeuron's `neuron` included) with no collective kernel registered for it.
DDP and FSDP2 then wrap and run the model exactly as a worker's set-up does, so TorchDynamo compiles the graphs that
worker compiles; the values are not a real run's, which a compile does not read.

Which ranks need a compile of their own is pure: a rank's graphs are fixed by the batch shapes it sees at each
planned key (`rank_shapes`), so ranks with the same shapes share every graph and one of them is compiled
(`distinct_ranks`).
"""

from __future__ import annotations

from datetime import timedelta

TRACE_BACKEND = "neurontrain-trace"


def _done(result):
    import torch
    from torch._C._distributed_c10d import _create_work_from_future  # lazy: see _create

    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _create(store, rank: int, size: int, timeout):  # torch.distributed's backend API
    import torch
    import torch.distributed as dist  # lazy: only a multi-worker precompile needs it

    class WithoutPeers(dist.ProcessGroup):
        def getBackendName(self) -> str:  # noqa: N802  # PyTorch's name
            return TRACE_BACKEND

        def allreduce(self, tensors, opts=None):
            return _done(tensors)

        def allreduce_coalesced(self, tensors, opts=None):
            return _done(tensors)

        def broadcast(self, tensors, opts=None):
            return _done(tensors)

        def allgather(self, output_lists, inputs, opts=None):
            for outputs, tensor in zip(output_lists, inputs, strict=True):
                for out in outputs:
                    out.copy_(tensor)
            return _done(output_lists)

        def _allgather_base(self, output, input, opts=None):
            # FSDP2 gathers in place: its input is this rank's slot of the output, so it is copied out first
            output.view(-1, input.numel()).copy_(input.reshape(1, -1).clone())
            return _done(output)

        def _reduce_scatter_base(self, output, input, opts=None):
            output.copy_(input.reshape(-1, output.numel())[self.rank()].view_as(output))
            return _done(output)

        def barrier(self, opts=None):
            return _done(None)

    from torch._C._distributed_c10d import FakeProcessGroup  # lazy: see above

    group = WithoutPeers(rank, size)
    # a group's name (DeviceMesh and FSDP2 read it) lives on its backends: PyTorch's peerless one for the host
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, FakeProcessGroup(rank, size))
    return group


def join_as(rank: int, world: int, device_type: str) -> None:
    """Make this process rank `rank` of a default process group of `world` ranks with no peers."""
    import torch.distributed as dist  # lazy: see _create

    if TRACE_BACKEND not in dist.Backend.backend_list:
        devices = sorted({"cpu", device_type})
        dist.Backend.register_backend(TRACE_BACKEND, _create, devices=devices)
    dist.init_process_group(TRACE_BACKEND, store=dist.HashStore(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip


def leave() -> None:
    import torch.distributed as dist  # lazy: see _create

    if dist.is_initialized():
        dist.destroy_process_group()


def distinct_ranks(shapes_by_rank: dict[int, list]) -> dict[int, list[int]]:
    """Ranks grouped by the shapes they see at every planned key: {representative (lowest rank): [ranks]} (pure)."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(shapes_by_rank):
        groups.setdefault(repr(shapes_by_rank[rank]), []).append(rank)
    return {members[0]: members for members in groups.values()}
