"""As parallel_layers/layers.py (NxD 2.29): ParallelEmbedding, ColumnParallelLinear, RowParallelLinear with NxD's
constructor signatures; each holds only its rank's shard (initialised as NxD does on CPU: the whole master
weight drawn, then the rank's chunk kept) and computes its part of the matmul, with NxD's collectives
(`mappings.py`). Options NxD has and this does not raise NotImplementedError."""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.nn.init as init
from torch.distributed import ProcessGroup
from torch.nn.parameter import Parameter

from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from .parallel_state import get_tensor_model_parallel_group, model_parallel_is_initialized
from .utils import divide, set_tensor_model_parallel_attributes


def _unsupported(**options: Any) -> None:
    used = [name for name, value in options.items() if value]
    if used:
        raise NotImplementedError(f"the NxD stand-in does not model {', '.join(used)}")


def _local_weight(shape: tuple, partition_dim: int, group: ProcessGroup, init_method: Callable) -> Parameter:
    """NxD's `_initialize_parameter_cpu`: the master weight drawn whole in fp32, the rank's chunk kept."""
    master_shape = list(shape)
    master_shape[partition_dim] *= group.size()
    master = torch.empty(master_shape, dtype=torch.float32)
    init_method(master)
    weight = Parameter(master.chunk(group.size(), dim=partition_dim)[group.rank()].clone())
    set_tensor_model_parallel_attributes(weight, True, partition_dim, 1, num_partitions=group.size())
    return weight


class BaseParallelLayer(torch.nn.Module):
    def __init__(self, device: torch.device | None = None):
        super().__init__()
        if not model_parallel_is_initialized():
            raise NotImplementedError("NxD falls back to a non-parallel state here; the stand-in does not")


class ParallelEmbedding(BaseParallelLayer):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: Callable[[Any], Any] = init.normal_,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        shard_across_embedding: bool = False,
        pad: bool = False,
        sequence_parallel_enabled: bool = False,
        tensor_model_parallel_group: ProcessGroup | None = None,
        use_spmd_rank: bool = False,
        sequence_dimension: int | None = None,
        tile_cc: bool = False,
        rank_ordering: list | None = None,
        collect_output: bool = True,
    ):
        super().__init__(device=device)
        _unsupported(
            max_norm=max_norm is not None,
            scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse,
            shard_across_embedding=shard_across_embedding,
            sequence_parallel_enabled=sequence_parallel_enabled,
            use_spmd_rank=use_spmd_rank,
            rank_ordering=rank_ordering is not None,
            collect_output=not collect_output,
            pad=pad,  # NxD refuses pad=True in training too
        )
        group = tensor_model_parallel_group or get_tensor_model_parallel_group()
        self.tensor_model_parallel_group, self.tensor_model_parallel_size = group, group.size()
        self.num_embeddings, self.embedding_dim, self.pad, self.dtype = num_embeddings, embedding_dim, pad, dtype
        per_partition = divide(num_embeddings, group.size())
        self.start_index, self.end_index = per_partition * group.rank(), per_partition * (group.rank() + 1)
        self.num_embeddings_per_partition = per_partition
        in_range = padding_idx is not None and self.start_index <= padding_idx < self.end_index
        self.padding_idx = padding_idx - self.start_index if in_range else None
        self.weight = _local_weight((per_partition, embedding_dim), 0, group, init_method)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.pad and self.training:
            raise RuntimeError("`pad=True` is only supported for inference. Set model.eval()")
        if self.tensor_model_parallel_size > 1:
            input_mask = (input_ >= self.start_index) & (input_ < self.end_index)
            masked_input = torch.mul(input_.clone() - self.start_index, input_mask.long())
        else:
            masked_input = input_
        output_parallel = F.embedding(masked_input.long(), self.weight, self.padding_idx)
        if self.tensor_model_parallel_size > 1:
            output_parallel = torch.mul(output_parallel, torch.unsqueeze(input_mask.to(output_parallel.dtype), -1))
        return reduce_from_tensor_model_parallel_region(output_parallel, process_group=self.tensor_model_parallel_group)


class ColumnParallelLinear(BaseParallelLayer):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        stride: int = 1,
        init_method: Callable[[Any], torch.Tensor] | None = None,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        keep_master_weight: bool = False,
        skip_bias_add: bool = False,
        pad: bool = False,
        pad_alignment_size_per_rank: int = 1,
        keep_padded_output: bool = False,
        tensor_model_parallel_group: ProcessGroup | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        rank_ordering: list | None = None,
    ):
        super().__init__(device=device)
        _unsupported(
            stride=stride != 1,
            sequence_parallel_enabled=sequence_parallel_enabled,
            skip_bias_add=skip_bias_add,
            pad=pad,
            rank_ordering=rank_ordering is not None,
        )
        group = tensor_model_parallel_group or get_tensor_model_parallel_group()
        self.tensor_parallel_group, self.gather_output, self.pad = group, gather_output, pad
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, group.size())
        self.weight = _local_weight(
            (self.output_size_per_partition, input_size), 0, group, init_method or _kaiming_uniform
        )
        if bias:
            # NxD: a gathered output's bias is whole, else split with the weight's rows
            size = output_size if gather_output else self.output_size_per_partition
            bound = 1 / math.sqrt(input_size) if input_size > 0 else 0
            self.bias = Parameter(torch.empty(size, dtype=dtype).uniform_(-bound, bound))
            if not gather_output:
                set_tensor_model_parallel_attributes(self.bias, True, 0, 1, num_partitions=group.size())
        else:
            self.register_parameter("bias", None)

    def forward(self, input: torch.Tensor, slice_indices: torch.Tensor | None = None) -> torch.Tensor:
        if self.pad and self.training:
            raise RuntimeError("`pad=True` is only supported for inference. Set model.eval()")
        _unsupported(slice_indices=slice_indices is not None)
        # NxD's async path all-reduces the input gradient inside the linear's backward: the same arithmetic
        input_parallel = copy_to_tensor_model_parallel_region(input, process_group=self.tensor_parallel_group)
        output = F.linear(input_parallel, self.weight)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, process_group=self.tensor_parallel_group)
        return output + self.bias if self.bias is not None else output


class RowParallelLinear(BaseParallelLayer):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        stride: int = 1,
        init_method: Callable[..., Any] | None = None,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        keep_master_weight: bool = False,
        skip_bias_add: bool = False,
        pad: bool = False,
        reduce_output: bool = True,
        tensor_model_parallel_group: ProcessGroup | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        tile_cc: bool = False,
        rank_ordering: list | None = None,
    ):
        super().__init__(device=device)
        _unsupported(
            input_is_parallel_false=not input_is_parallel,
            stride=stride != 1,
            sequence_parallel_enabled=sequence_parallel_enabled,
            skip_bias_add=skip_bias_add,
            pad=pad,
            reduce_output_false=not reduce_output,
            rank_ordering=rank_ordering is not None,
        )
        group = tensor_model_parallel_group or get_tensor_model_parallel_group()
        self.tensor_parallel_group, self.input_is_parallel, self.pad = group, input_is_parallel, pad
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, group.size())
        self.weight = _local_weight(
            (output_size, self.input_size_per_partition), 1, group, init_method or _kaiming_uniform
        )
        if bias:
            bound = 1 / math.sqrt(self.input_size_per_partition)
            self.bias = Parameter(torch.empty(output_size, dtype=dtype).uniform_(-bound, bound))  # whole, not split
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, slice_indices: torch.Tensor | None = None) -> torch.Tensor:
        if self.pad and self.training:
            raise RuntimeError("`pad=True` is only supported for inference. Set model.eval()")
        _unsupported(slice_indices=slice_indices is not None)
        output_ = F.linear(input_, self.weight)
        output_ = reduce_from_tensor_model_parallel_region(output_, process_group=self.tensor_parallel_group)
        return output_ + self.bias if self.bias is not None else output_


def _kaiming_uniform(weight: torch.Tensor) -> None:
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
