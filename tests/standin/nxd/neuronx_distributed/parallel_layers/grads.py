"""As parallel_layers/grads.py (NxD 2.29): `clip_grad_norm` with NxD's rule for the norm (force_spmd): the
squared norms of tensor-parallel gradients counted on every rank, those of duplicated (replicated)
parameters divided by the TP size, summed over the TP group; then every gradient scaled by
max_norm / (norm + 1e-6) where that is below 1. The sum runs over gloo on a host copy."""

from collections.abc import Iterable

import torch

from .mappings import _host_all_reduce
from .parallel_state import get_tensor_model_parallel_group, get_tensor_model_parallel_size


def get_grad_norm(
    parameters,
    norm_type: float | int = 2,
    zero1_optimizer: bool = False,
    zero1_optimizer_groups: list[list[int]] | None = None,
    force_spmd: bool = True,
):
    if zero1_optimizer or zero1_optimizer_groups is not None or not force_spmd or float(norm_type) != 2.0:
        raise NotImplementedError("the NxD stand-in computes NxD's 2-norm with force_spmd only")
    params: list[torch.Tensor] = [parameters] if not isinstance(parameters, list) else parameters
    device, dtype = params[0].device, params[0].dtype
    total_norm = torch.tensor([0.0], dtype=dtype, device=device)
    duplicated = torch.tensor([0.0], dtype=dtype, device=device)
    for param in params:
        if param.grad is None or getattr(param, "shared", False):
            continue
        square = torch.norm(param.grad.detach(), 2.0) ** 2
        if getattr(param, "tensor_model_parallel", False):
            total_norm = total_norm + square
        else:
            duplicated = duplicated + square
    total_norm = total_norm + duplicated / get_tensor_model_parallel_size()
    total_norm = _host_all_reduce(total_norm, get_tensor_model_parallel_group())
    return torch.pow(total_norm, 0.5)


def clip_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float | int,
    norm_type: float | int = 2,
    zero1_optimizer: bool = False,
    zero1_optimizer_groups: list[list[int]] | None = None,
    force_spmd: bool = True,
):
    params = [parameters] if not isinstance(parameters, list) else parameters
    total_norm = get_grad_norm(
        params,
        norm_type=norm_type,
        zero1_optimizer=zero1_optimizer,
        zero1_optimizer_groups=zero1_optimizer_groups,
        force_spmd=force_spmd,
    )
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    for param in params:
        if param.grad is not None:
            param.grad.detach().mul_(
                torch.where(clip_coeff < 1, clip_coeff.to(total_norm.dtype), torch.ones_like(clip_coeff))
            )
    return total_norm
