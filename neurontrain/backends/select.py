"""Which runtime we are on (Neuron, XLA:CPU, XLA:CUDA, native `torch.compile`, or eager PyTorch), chosen once:
`select_backend` / `backend_for` return the `Backend` of that runtime.

Nothing is imported or initialised at import time: `select_backend()` does the work.
"""

from __future__ import annotations

import warnings
from typing import Any

from neurontrain.backends.base import Backend
from neurontrain.backends.eager import select_eager
from neurontrain.backends.names import is_xla_backend, resolve_backend_name
from neurontrain.backends.native import select_native
from neurontrain.backends.xla import select_xla


def select_backend(
    requested: str = "auto",
    compiler_flags: list[str] | None = None,
    xla_flags: list[str] | None = None,
    fullgraph: bool | None = None,
) -> Backend:
    """compiler_flags are neuronx-cc flags: the Neuron runtime receives them (compile/neuron_runtime.py), XLA
    never does. xla_flags are checked, then appended to XLA_FLAGS on the XLA backends."""
    name = resolve_backend_name(requested)
    flags = list(compiler_flags or [])
    if is_xla_backend(name):
        return select_xla(name, flags, list(xla_flags or []))
    return select_native(flags, fullgraph) if name == "native" else select_eager(flags)


def backend_for(runtime: Any) -> Backend:
    """The backend of a recipe's `runtime` section; float32 matmuls at runtime.matmul_precision ("high": TF32 on
    CUDA), set once here for the process."""
    import torch  # lazy: see the module docstring

    with warnings.catch_warnings():  # torch 2.9 warns on each call that a newer API exists; this one is kept
        warnings.simplefilter("ignore", UserWarning)
        if torch.get_float32_matmul_precision() != runtime.matmul_precision:
            torch.set_float32_matmul_precision(runtime.matmul_precision)
    return select_backend(runtime.backend, list(runtime.compiler_flags), list(runtime.xla_flags), runtime.fullgraph)


def package_versions() -> dict[str, str | None]:
    from importlib import metadata

    out = {}
    for pkg in (
        "torch",
        "torch-xla",
        "transformers",
        "tokenizers",
        "safetensors",
        "datasets",
        "pydantic",
        "torch-neuronx",
        "neuronx-cc",
        "libneuronxla",
        "tensorboard",
        "boto3",
    ):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out
