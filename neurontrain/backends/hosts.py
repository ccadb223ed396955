"""What this host has, asked without initialising any runtime: which Neuron stack is installed (by Neuron's
documented rule), whether torch-xla is, and which device the native backend targets.

Neuron's rule (setup guide, Neuron 2.33: "Starting with Neuron 2.33.0, torch-neuronx for PyTorch 2.13 and 2.14
is TorchNeuron, the native PyTorch backend for Trainium"; the torch-xla-based torch-neuronx 2.9 last shipped in
Neuron 2.31): the `torch-neuronx` distribution's version says which one it is, 2.13.x / 2.14.x TorchNeuron,
earlier the XLA library.
"""

from __future__ import annotations

import importlib.util
import os
from importlib import metadata

TORCHNEURON_SINCE = (2, 13)  # torch-neuronx releases from this torch minor on are TorchNeuron (native PyTorch)


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def is_torchneuron_version(version: str) -> bool:
    """Whether a torch-neuronx version is TorchNeuron (2.13.x, 2.14.x, later) rather than the XLA library."""
    minor = _minor(version)
    return minor is not None and minor >= TORCHNEURON_SINCE


def torch_neuronx_version() -> str | None:
    try:
        return metadata.version("torch-neuronx")
    except metadata.PackageNotFoundError:
        return None


def neuron_stack() -> str | None:
    """`torchneuron` (native PyTorch), `xla` (torch-neuronx on torch-xla) or None (no torch-neuronx)."""
    version = torch_neuronx_version()
    if version is None or importlib.util.find_spec("torch_neuronx") is None:
        return None
    return "torchneuron" if is_torchneuron_version(version) else "xla"


def torch_xla_installed() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def skip_torch_xla_imports() -> None:
    """For a process that never uses an XLA device (native, eager, a launcher): the libraries imported from here
    on do not import torch_xla for it (accelerate reads USE_TORCH_XLA when first imported; about 2 s of
    start-up). A value the user set is kept."""
    os.environ.setdefault("USE_TORCH_XLA", "0")


def cuda_available() -> bool:
    """torch's own answer (initialises nothing on a host without CUDA; asks the driver on one with it)."""
    import torch  # lazy: only a run without a named backend asks

    return torch.cuda.is_available()


def native_device_type() -> str:
    """The device type the native backend runs on here: `neuron` with TorchNeuron, `cuda` with a GPU, else `cpu`."""
    if neuron_stack() == "torchneuron":
        return "neuron"
    return "cuda" if cuda_available() else "cpu"
