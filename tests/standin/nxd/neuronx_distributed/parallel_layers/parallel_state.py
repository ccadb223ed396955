"""As parallel_layers/parallel_state.py (NxD 2.29) in its CPU mode (`NXD_CPU_MODE=1`: every group a gloo group,
created by every rank): ranks reshaped to [PP, DP, CP, TP] with TP contiguous, as `initialize_model_parallel`
documents (NxD's trn1 TP=4 layout, non-contiguous, is not modelled). Pipeline, context and expert
parallelism are not here."""

import torch
import torch.distributed
from torch.distributed import ProcessGroup

_TENSOR_MODEL_PARALLEL_GROUP: ProcessGroup | None = None
_TENSOR_MODEL_PARALLEL_GROUP_SPMD: list[list[int]] | None = None
_DATA_PARALLEL_GROUP: ProcessGroup | None = None
_DATA_PARALLEL_GROUP_SPMD: list[list[int]] | None = None
_WORLD_GROUP: ProcessGroup | None = None
_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE: int | None = None
_MPU_TENSOR_MODEL_PARALLEL_RANK: int | None = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    skip_collective_init: bool = False,
    lnc_size: int = 1,
    mesh_only: bool = False,
):
    global _TENSOR_MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP_SPMD
    global _DATA_PARALLEL_GROUP, _DATA_PARALLEL_GROUP_SPMD, _WORLD_GROUP
    if (pipeline_model_parallel_size, context_parallel_size, expert_model_parallel_size) != (1, 1, 1) or mesh_only:
        raise NotImplementedError("the NxD stand-in has tensor and data parallelism only")
    rank = torch.distributed.get_rank()  # NxD's first call too: the process group must be up
    world_size: int = torch.distributed.get_world_size()
    tensor_model_parallel_size = min(tensor_model_parallel_size, world_size)
    if world_size % tensor_model_parallel_size != 0:
        raise RuntimeError(
            f"invalid implied data parallel degree: `world_size` ({world_size}) is not divisible by "
            f"tensor_model_parallel_size ({tensor_model_parallel_size})"
        )
    data_parallel_size = world_size // tensor_model_parallel_size
    ranks = torch.arange(world_size).reshape(data_parallel_size, tensor_model_parallel_size)
    tp_groups = ranks.tolist()
    dp_groups = ranks.t().tolist()
    _WORLD_GROUP = torch.distributed.new_group(list(range(world_size)), backend="gloo")
    _TENSOR_MODEL_PARALLEL_GROUP_SPMD, _DATA_PARALLEL_GROUP_SPMD = tp_groups, dp_groups
    for mesh, name in ((tp_groups, "_TENSOR_MODEL_PARALLEL_GROUP"), (dp_groups, "_DATA_PARALLEL_GROUP")):
        for group_ranks in mesh:
            group = torch.distributed.new_group(group_ranks, backend="gloo")  # every rank joins every creation
            if rank in group_ranks:
                globals()[name] = group


def model_parallel_is_initialized() -> bool:
    return _TENSOR_MODEL_PARALLEL_GROUP is not None and _DATA_PARALLEL_GROUP is not None


def get_world_group(as_list: bool = False) -> ProcessGroup:
    assert _WORLD_GROUP is not None, "intra_layer_model parallel group is not initialized"
    if as_list:
        raise NotImplementedError("the NxD stand-in keeps no mesh on the world group")
    return _WORLD_GROUP


def get_tensor_model_parallel_group(as_list: bool = False) -> ProcessGroup:
    if as_list:
        return get_tensor_model_parallel_replica_groups()
    assert _TENSOR_MODEL_PARALLEL_GROUP, "intra_layer_model parallel group is not initialized"
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_tensor_model_parallel_replica_groups() -> list[list[int]]:
    assert _TENSOR_MODEL_PARALLEL_GROUP_SPMD is not None, "intra_layer_model parallel group is not initialized"
    return _TENSOR_MODEL_PARALLEL_GROUP_SPMD


def get_data_parallel_group(as_list: bool = False) -> ProcessGroup | list[list[int]]:
    if as_list:
        return get_data_parallel_replica_groups()
    assert _DATA_PARALLEL_GROUP, "data parallel group is not initialized"
    return _DATA_PARALLEL_GROUP


def get_data_parallel_replica_groups() -> list[list[int]]:
    assert _DATA_PARALLEL_GROUP_SPMD is not None, "data parallel group is not initialized"
    return _DATA_PARALLEL_GROUP_SPMD


def get_tensor_model_parallel_size() -> int:
    if _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    return torch.distributed.get_world_size(group=get_tensor_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    if _MPU_TENSOR_MODEL_PARALLEL_RANK is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_RANK
    return torch.distributed.get_rank(group=get_tensor_model_parallel_group())


def get_data_parallel_size() -> int:
    return torch.distributed.get_world_size(group=get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return torch.distributed.get_rank(group=get_data_parallel_group())


def destroy_model_parallel() -> None:
    global _TENSOR_MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP_SPMD
    global _DATA_PARALLEL_GROUP, _DATA_PARALLEL_GROUP_SPMD, _WORLD_GROUP
    _TENSOR_MODEL_PARALLEL_GROUP = _TENSOR_MODEL_PARALLEL_GROUP_SPMD = None
    _DATA_PARALLEL_GROUP = _DATA_PARALLEL_GROUP_SPMD = _WORLD_GROUP = None
