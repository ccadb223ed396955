"""Which Neuron stack a host has, by Neuron's documented rule: torch-neuronx 2.13.x / 2.14.x is TorchNeuron
(native PyTorch), earlier releases are the torch-xla library."""

import pytest

from neurontrain.backends.hosts import is_torchneuron_version, neuron_stack, torch_xla_installed


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
