"""Backend names and what a name alone tells (no torch import): for planning, validation and launchers, which
decide before any backend exists. Code that holds a `Backend` asks the object instead."""

from __future__ import annotations

import glob
import importlib.util
import os

from neurontrain.errors import UsageError

BACKENDS = ("neuron", "xla-cpu", "xla-cuda", "native", "eager")
XLA_BACKENDS = ("neuron", "xla-cpu", "xla-cuda")


def is_xla_backend(name: str) -> bool:
    """Whether a backend name (after `resolve_backend_name`) runs through torch-xla."""
    return name in XLA_BACKENDS


def neuron_devices() -> list[str]:
    return sorted(glob.glob("/dev/neuron[0-9]*"))


def neuron_available() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None and bool(neuron_devices())


def neuron_runtime_present() -> bool:
    """Whether the Neuron runtime's compiler and compile cache (libneuronxla, part of torch-neuronx) is here."""
    return importlib.util.find_spec("libneuronxla") is not None


def resolve_backend_name(requested: str) -> str:
    """`auto` -> neuron when torch-neuronx and /dev/neuron* exist, xla-cuda when PJRT_DEVICE asks for it,
    else xla-cpu. `native` is chosen by name only."""
    if requested != "auto":
        if requested not in BACKENDS:
            raise UsageError(f"unknown backend {requested!r} (choose from auto, {', '.join(BACKENDS)})")
        return requested
    if neuron_available():
        return "neuron"
    if os.environ.get("PJRT_DEVICE", "").upper() in ("CUDA", "GPU"):
        return "xla-cuda"
    return "xla-cpu"
