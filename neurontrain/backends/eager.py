"""Eager PyTorch: ops run as called, on CUDA where present, else the CPU; nothing compiles."""

from __future__ import annotations

from neurontrain.backends.base import Backend
from neurontrain.backends.hosts import skip_torch_xla_imports


class EagerBackend(Backend):
    """The base class's host-run defaults, unchanged: eager is the reference the other runtimes are compared to."""


def select_eager(compiler_flags: list[str]) -> EagerBackend:
    import torch

    skip_torch_xla_imports()
    return EagerBackend("eager", "nccl" if torch.cuda.is_available() else "gloo", False, compiler_flags)
