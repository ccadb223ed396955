"""Backend names and what a name alone tells (no torch import): for planning, validation and launchers, which
decide before any backend exists. Code that holds a `Backend` asks the object instead."""

from __future__ import annotations

import glob
import importlib.util
import os

from neurontrain.backends.hosts import cuda_available, neuron_stack, torch_xla_installed
from neurontrain.errors import UsageError
from neurontrain.logs import get_logger

BACKENDS = ("neuron", "xla-cpu", "xla-cuda", "native", "eager")
XLA_BACKENDS = ("neuron", "xla-cpu", "xla-cuda")


def is_xla_backend(name: str) -> bool:
    """Whether a backend name (after `resolve_backend_name`) runs through torch-xla."""
    return name in XLA_BACKENDS


def neuron_devices() -> list[str]:
    return sorted(glob.glob("/dev/neuron[0-9]*"))


def neuron_available() -> bool:
    """The torch-xla torch-neuronx (trn1's stack, by Neuron's version rule) with /dev/neuron* devices."""
    return neuron_stack() == "xla" and bool(neuron_devices())


def neuron_runtime_present() -> bool:
    """Whether the Neuron runtime's compiler and compile cache (libneuronxla, part of torch-neuronx) is here."""
    return importlib.util.find_spec("libneuronxla") is not None


def resolve_backend_name(requested: str) -> str:
    """`auto`, in order: TorchNeuron installed -> native (on `neuron`); the torch-xla torch-neuronx with
    /dev/neuron* -> neuron; PJRT_DEVICE=CUDA -> xla-cuda; torch-xla installed -> xla-cpu; without torch-xla,
    native on a GPU, else eager (said once per process: the user asked for neither)."""
    if requested != "auto":
        if requested not in BACKENDS:
            raise UsageError(f"unknown backend {requested!r} (choose from auto, {', '.join(BACKENDS)})")
        return requested
    name, why = auto_backend()
    return _said(name, why) if why else name


def auto_backend() -> tuple[str, str | None]:
    """What `auto` is on this host, and why where the user may not expect it (said once by resolve_backend_name).
    On CUDA without torch-xla a run prices eager against native for its whole job (plan/backend_choice.py)."""
    stack = neuron_stack()
    if stack == "torchneuron":
        return "native", "TorchNeuron (torch-neuronx 2.13+) is installed: native torch.compile on `neuron`"
    if stack == "xla" and neuron_devices():
        return "neuron", None
    if os.environ.get("PJRT_DEVICE", "").upper() in ("CUDA", "GPU"):
        return "xla-cuda", None
    if torch_xla_installed():
        return "xla-cpu", None
    if cuda_available():
        return "native", "torch-xla is not installed: native torch.compile (inductor) on CUDA"
    return "eager", "torch-xla is not installed and there is no GPU: eager PyTorch on the CPU"


_SAID: set[str] = set()


def _said(name: str, why: str) -> str:
    if why not in _SAID:
        _SAID.add(why)
        get_logger(__name__).info(f"backend auto -> {name}: {why}")
    return name
