"""As parallel_layers/mappings.py (NxD 2.29): the autograd regions around tensor-parallel layers. NxD's
collectives are `xm.all_reduce` / `xm.all_gather` in the graph; here they run over the group's gloo process
group on host copies, and the result comes back to the input's device as data."""

import torch
import torch.distributed
from torch.distributed import ProcessGroup

from .parallel_state import get_tensor_model_parallel_group


def _host_all_reduce(input_: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    host = input_.detach().to("cpu", torch.float32)
    torch.distributed.all_reduce(host, group=group)
    return host.to(device=input_.device, dtype=input_.dtype)


def _reduce(input_: torch.Tensor, process_group: ProcessGroup | None = None) -> torch.Tensor:
    group = process_group if process_group is not None else get_tensor_model_parallel_group()
    if group.size() == 1:
        return input_
    return _host_all_reduce(input_, group)


def _split_along_last_dim(input_: torch.Tensor, process_group: ProcessGroup | None = None) -> torch.Tensor:
    group = process_group if process_group is not None else get_tensor_model_parallel_group()
    if group.size() == 1:
        return input_
    return input_.chunk(group.size(), dim=-1)[group.rank()].contiguous()


def _gather_along_last_dim(x: torch.Tensor, process_group: ProcessGroup | None = None) -> torch.Tensor:
    group = process_group if process_group is not None else get_tensor_model_parallel_group()
    if group.size() == 1:
        return x
    host = x.detach().cpu().contiguous()
    pieces = [torch.empty_like(host) for _ in range(group.size())]
    torch.distributed.all_gather(pieces, host, group=group)
    return torch.cat(pieces, dim=-1).to(x.device)


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, process_group: ProcessGroup | None = None):
        ctx.process_group = process_group if process_group is not None else get_tensor_model_parallel_group()
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, process_group=ctx.process_group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, process_group: ProcessGroup | None = None):
        return _reduce(input_, process_group=process_group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, process_group: ProcessGroup | None = None):
        ctx.process_group = process_group if process_group is not None else get_tensor_model_parallel_group()
        return _split_along_last_dim(input_, process_group=ctx.process_group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, process_group=ctx.process_group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, process_group: ProcessGroup | None = None):
        ctx.process_group = process_group if process_group is not None else get_tensor_model_parallel_group()
        return _gather_along_last_dim(input_, process_group=ctx.process_group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, process_group=ctx.process_group), None


def copy_to_tensor_model_parallel_region(input_, process_group: ProcessGroup | None = None):
    return _CopyToModelParallelRegion.apply(input_, process_group)


def reduce_from_tensor_model_parallel_region(input_, process_group: ProcessGroup | None = None):
    return _ReduceFromModelParallelRegion.apply(input_, process_group)


def scatter_to_tensor_model_parallel_region(input_, process_group: ProcessGroup | None = None):
    return _ScatterToModelParallelRegion.apply(input_, process_group)


def gather_from_tensor_model_parallel_region(
    input_,
    process_group: ProcessGroup | None = None,
) -> torch.Tensor:
    return _GatherFromModelParallelRegion.apply(input_, process_group)
