"""A stand-in for TorchNeuron (torch-neuronx 2.14, native PyTorch on trn2/trn3), enforcing its documented contract.

What it enforces, each from Neuron's documentation (docs/neuron-contracts.md, TorchNeuron section):
- the device is PyTorch's PrivateUse1 backend renamed `neuron`, registered when torch_neuronx is imported;
- the `neuron` process-group backend refuses a process whose Neuron runtime is already initialised, and sets
  NEURON_RT_VISIBLE_CORES from LOCAL_RANK (and NEURON_RT_ROOT_COMM_ID) before the runtime starts: the first use of
  the device initialises the runtime, which without NEURON_RT_VISIBLE_CORES takes every core of the host;
- `torch.compile(backend="neuron")` goes through AOTAutograd (TorchDynamo -> AOT Autograd -> the Neuron compiler,
  one NEFF per forward, backward or inference module), rejects dynamic=True and keeps what it compiles in
  TORCH_NEURONX_NEFF_CACHE_DIR
  (default /tmp/neuron_backend... here: the variable must be set or the stand-in's default under /tmp is used),
  a graph found there is loaded instead of compiled; each NEFF is registered with torch.compiler's cache artifacts
  (save_cache_artifacts carries it, load_cache_artifacts writes it back into the directory);
- with TORCHNEURON_STANDIN_DEVICE=1 the device holds tensors (device.cpp: host memory, PyTorch's CPU fallback for
  every operator, built once per machine by _device.py) and the first allocation initialises the runtime; the
  `neuron` process group then runs collectives on neuron tensors through gloo on host copies
  (_process_group.py). Without it an op on `neuron` fails with PyTorch's own "Could not run 'aten::...'" error.
What it cannot do: compile anything (a "NEFF" is the graph's code; the graph runs op by op on the host).

Every event goes as one JSON line to $TORCHNEURON_STANDIN_LOG (when set), for the tests to read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import types

import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.compiler._cache import CacheArtifact, CacheArtifactFactory, CacheArtifactManager

from . import _device, _process_group

CORES_ON_THE_HOST = int(os.environ.get("TORCHNEURON_STANDIN_CORES", "8"))
_state: dict = {"runtime_cores": None, "process_group": False, "device": None}


def _log(event: str, **fields) -> None:
    path = os.environ.get("TORCHNEURON_STANDIN_LOG")
    if path:
        line = {"event": event, "pid": os.getpid(), "local_rank": os.environ.get("LOCAL_RANK"), **fields}
        with open(path, "a") as fh:
            fh.write(json.dumps(line) + "\n")


def _visible_cores() -> list[int]:
    """NEURON_RT_VISIBLE_CORES as the runtime reads it: "3", "0-3" or "0,1"; unset: every core of the host."""
    value = os.environ.get("NEURON_RT_VISIBLE_CORES")
    if not value:
        return list(range(CORES_ON_THE_HOST))
    cores: list[int] = []
    for part in value.split(","):
        low, _, high = part.partition("-")
        cores += list(range(int(low), int(high or low) + 1))
    return cores


def _initialise_runtime(why: str) -> list[int]:
    """The first device use starts the runtime, which claims the visible cores for this process."""
    if _state["runtime_cores"] is None:
        _state["runtime_cores"] = _visible_cores()
        _log("runtime initialised", why=why, cores=_state["runtime_cores"], process_group=_state["process_group"])
        if _state["device"] is not None:
            _device.set_device_count(_state["device"], len(_state["runtime_cores"]))
    return _state["runtime_cores"]


class _Stream:
    """The stand-in's device runs every operation when it is called (host memory), so its streams and events are
    always in order: waiting on one returns at once. FSDP2 asks the device module for them."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass


class _Event:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_STREAM = _Stream()


def _device_module() -> types.ModuleType:
    module = types.ModuleType("torch.neuron")
    module.Stream, module.Event = _Stream, _Event
    module.current_stream = lambda device=None: _STREAM
    module.stream = lambda stream: contextlib.nullcontext()
    module.synchronize = lambda device=None: None
    module.is_available = lambda: True
    module.device_count = lambda: len(_initialise_runtime("device_count"))
    module.current_device = lambda: 0
    module.is_initialized = lambda: _state["runtime_cores"] is not None
    module._is_in_bad_fork = lambda: False
    module.manual_seed_all = lambda seed: None
    return module


def _create_process_group(store, rank: int, size: int, timeout):
    if _state["runtime_cores"] is not None:
        _log("refused process group", reason="runtime already initialised")
        raise RuntimeError(
            "TorchNeuron stand-in: the Neuron runtime is already initialised in this process; "
            "init_process_group('neuron') must come before any use of the neuron device"
        )
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    per_worker = CORES_ON_THE_HOST // local_world
    first = local_rank * per_worker
    os.environ["NEURON_RT_VISIBLE_CORES"] = f"{first}-{first + per_worker - 1}" if per_worker > 1 else str(first)
    os.environ.setdefault("NEURON_RT_ROOT_COMM_ID", f"{os.environ.get('MASTER_ADDR', 'localhost')}:62182")
    _state["process_group"] = True
    _log("process group", rank=rank, size=size, visible_cores=os.environ["NEURON_RT_VISIBLE_CORES"])
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    return gloo if _state["device"] is None else _process_group.OnHostCopies(gloo, rank, size)


def _neff_dir() -> str:
    return os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR") or "/tmp/neuron_backend/neff_cache"


def _neff_path(key: str) -> str:
    return os.path.join(_neff_dir(), f"MODULE_{key}", "graph.neff")


class _NeffArtifact(CacheArtifact):
    """A NEFF as torch.compiler.save_cache_artifacts carries it; load_cache_artifacts puts it back in the cache
    directory (where the next compile of the graph finds it)."""

    def populate_cache(self) -> None:
        path = _neff_path(self.key)
        if not os.path.isfile(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(self.content)

    @staticmethod
    def type() -> str:
        return "neuron_neff"


def _neff_module(gm: torch.fx.GraphModule, example_inputs: list):
    """One module AOTAutograd hands the backend (a forward, a backward or an inference graph): its NEFF is looked
    up in the cache directory first, compiled (written) when absent, and recorded for save_cache_artifacts. The
    module then runs as traced, op by op (on the stand-in's host memory when the device is loaded)."""
    shapes = [list(x.shape) if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs]
    key = hashlib.sha256((gm.code + json.dumps(shapes)).encode()).hexdigest()[:20]
    path = _neff_path(key)
    if os.path.isfile(path):
        _log("neff loaded", key=key)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(gm.code)
        _log("neff compiled", key=key)
    with open(path, "rb") as fh:
        CacheArtifactManager.record_artifact(_NeffArtifact.type(), key, fh.read())
    return make_boxed_func(gm.forward)


def _compile(gm: torch.fx.GraphModule, example_inputs: list):
    """The `neuron` torch.compile backend: static shapes only; TorchDynamo's graph goes through AOTAutograd, which
    hands its forward and backward (or inference) modules to the Neuron compiler one by one (_neff_module)."""
    symbolic = [x for x in example_inputs if isinstance(x, torch.SymInt)]
    symbolic += [x for x in example_inputs if isinstance(x, torch.Tensor) and any(
        isinstance(s, torch.SymInt) for s in x.shape)]  # fmt: skip
    if symbolic:
        _log("refused dynamic")
        raise RuntimeError("TorchNeuron stand-in: dynamic=True is rejected (dynamic shapes are not supported)")
    return _AOT(gm, example_inputs)


_AOT = aot_autograd(fw_compiler=_neff_module, bw_compiler=_neff_module)


def _first_use(why: str) -> None:
    _initialise_runtime(f"first {why}")


def _register() -> None:
    if torch._C._get_privateuse1_backend_name() != "neuron":
        if os.environ.get("TORCHNEURON_STANDIN_DEVICE") == "1":
            _state["device"] = _device.load(_first_use)
        torch.utils.rename_privateuse1_backend("neuron")
        torch._register_device_module("neuron", _device_module())
        devices = ["cpu"] if _state["device"] is None else ["cpu", "neuron"]
        dist.Backend.register_backend("neuron", _create_process_group, devices=devices)
        from torch._dynamo import register_backend

        CacheArtifactFactory.register(_NeffArtifact)
        register_backend(_compile, name="neuron")
    _log("imported", argv=sys.argv[:3])


_register()
