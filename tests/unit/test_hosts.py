"""Which Neuron stack a host has, by Neuron's documented rule: torch-neuronx 2.13.x / 2.14.x is TorchNeuron
(native PyTorch), earlier releases are the torch-xla library."""

import pytest

from neurontrain.backends import names
from neurontrain.backends.hosts import is_torchneuron_version, neuron_stack, torch_xla_installed
from neurontrain.logs import get_logger


@pytest.mark.parametrize(
    ("version", "native"),
    [
        ("2.14.3.0", True),  # Neuron 2.33's TorchNeuron releases
        ("2.13.3.0", True),
        ("2.15.0", True),
        ("2.9.0.2.15.32035", False),  # Neuron 2.31's torch-xla torch-neuronx
        ("2.1.2.2.3.0", False),
        ("1.13.1.1.13.0", False),
        ("not-a-version", False),
    ],
)
def test_the_version_tells_torchneuron_from_the_xla_library(version, native):
    assert is_torchneuron_version(version) is native


def test_this_host_has_no_neuron_stack_and_has_torch_xla():
    assert neuron_stack() is None and torch_xla_installed()


@pytest.mark.parametrize(
    ("xla", "cuda", "stack", "want"),
    [
        (True, False, None, "xla-cpu"),  # this machine
        (False, True, None, "native"),  # a CUDA host next to the user's torch 2.11
        (False, False, None, "eager"),
        (True, True, "torchneuron", "native"),  # TorchNeuron wins whatever else is installed
    ],
)
def test_auto_without_torch_xla_picks_a_working_backend_and_says_which(monkeypatch, caplog, xla, cuda, stack, want):
    monkeypatch.setattr(names, "torch_xla_installed", lambda: xla)
    monkeypatch.setattr(names, "cuda_available", lambda: cuda)
    monkeypatch.setattr(names, "neuron_stack", lambda: stack)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(names, "_SAID", set())
    package_logger = get_logger()  # the package's logger does not propagate: listen to it directly
    package_logger.addHandler(caplog.handler)
    try:
        assert names.resolve_backend_name("auto") == want
    finally:
        package_logger.removeHandler(caplog.handler)
    said = [r.getMessage() for r in caplog.records if "backend auto" in r.getMessage()]
    assert bool(said) == (want != "xla-cpu"), said
