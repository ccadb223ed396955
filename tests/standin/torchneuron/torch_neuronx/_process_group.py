"""The stand-in's `neuron` process group once its device holds tensors: gloo takes CPU tensors only, so each
collective copies neuron tensors to the host, runs gloo there, and copies the results back (a Python
`dist.ProcessGroup`, as PyTorch's own test process groups are). CPU tensors go to gloo as they are."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future


def _done(result=None):
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t if t.device.type == "cpu" else t.cpu() for t in tensors]


def _back(devices: list[torch.Tensor], hosts: list[torch.Tensor]) -> None:
    for device, host in zip(devices, hosts, strict=True):
        if device is not host:
            device.copy_(host)


class OnHostCopies(dist.ProcessGroup):
    def __init__(self, gloo: dist.ProcessGroupGloo, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.gloo = gloo
        # the group's name (DeviceMesh and FSDP2 read it) lives on its backends: gloo serves the host's tensors
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)

    def getBackendName(self) -> str:  # noqa: N802  # PyTorch's name
        return "neuron"

    def allreduce(self, tensors, opts=None):
        hosts = _host(tensors)
        self.gloo.allreduce(hosts, opts or dist.AllreduceOptions()).wait()
        _back(tensors, hosts)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, dist.AllreduceOptions() if opts is None else _allreduce_options(opts))

    def broadcast(self, tensors, opts=None):
        hosts = _host(tensors)
        self.gloo.broadcast(hosts, opts or dist.BroadcastOptions()).wait()
        _back(tensors, hosts)
        return _done(tensors)

    def allgather(self, output_lists, inputs, opts=None):
        host_lists = [_host(outputs) for outputs in output_lists]
        self.gloo.allgather(host_lists, _host(inputs), opts or dist.AllgatherOptions()).wait()
        for outputs, hosts in zip(output_lists, host_lists, strict=True):
            _back(outputs, hosts)
        return _done(output_lists)

    def _allgather_base(self, output, input, opts=None):
        host = output if output.device.type == "cpu" else output.cpu()
        self.gloo._allgather_base(host, _host([input])[0], opts or dist.AllgatherOptions()).wait()
        _back([output], [host])
        return _done(output)

    def _reduce_scatter_base(self, output, input, opts=None):
        host = output if output.device.type == "cpu" else output.cpu()
        self.gloo._reduce_scatter_base(host, _host([input])[0], opts or dist.ReduceScatterOptions()).wait()
        _back([output], [host])
        return _done(output)

    def barrier(self, opts=None):
        return self.gloo.barrier(opts or dist.BarrierOptions())


def _allreduce_options(opts) -> dist.AllreduceOptions:
    out = dist.AllreduceOptions()
    out.reduceOp = opts.reduceOp
    return out
