"""`neurontrain health --backend native`: the compiler check agrees with eager only when the compiler does, and
where the native workers' device is (the shared host here)."""

import dataclasses

import pytest
import torch

from neurontrain.backends import NativeBackend, select_backend
from neurontrain.health.runner import workers_share_the_host
from neurontrain.health.worker import device_checks


def _off_by_a_little(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """A torch.compile backend standing in for a broken compiler: its outputs are off by 0.01."""

    def run(*args):
        return [out + 0.01 for out in gm(*args)]

    return run


@pytest.fixture
def native(monkeypatch):
    monkeypatch.setenv("USE_TORCH_XLA", "0")  # select_backend sets it for transformers; keep it to this test
    yield select_backend("native")
    torch._dynamo.reset()  # drop the compiled functions (and the fake tensors their traces keep)


@pytest.mark.parametrize("compiler", ["eager", _off_by_a_little])
def test_the_compile_check_fails_only_when_the_compiler_is_wrong(native, compiler):
    # a target is data: the same device with another torch.compile backend (TorchDynamo's eager: a faithful one)
    backend = NativeBackend(dataclasses.replace(native.target, compiler=compiler), [])
    results = {r["check"]: r for r in device_checks(backend, None, compiler=True)}
    assert set(results) == {"device matmul", "device reductions", "device bf16", "device compile"}
    if compiler == "eager":
        assert all(r["ok"] for r in results.values())
    else:
        assert not results["device compile"]["ok"]
        assert results["device compile"]["problem"] == "compiled function differs from eager on the CPU by 0.01"
    assert "device compile" not in {r["check"] for r in device_checks(backend, None)}  # preflight's form


def test_native_workers_share_the_host_here():
    assert workers_share_the_host("native") and workers_share_the_host("xla-cpu")
    assert not workers_share_the_host("neuron")
