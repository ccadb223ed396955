"""A stand-in for TorchNeuron (torch-neuronx 2.14, native PyTorch on trn2/trn3), enforcing its documented contract.

What it enforces, each from Neuron's documentation (docs/neuron-contracts.md, TorchNeuron section):
- the device is PyTorch's PrivateUse1 backend renamed `neuron`, registered when torch_neuronx is imported;
- the `neuron` process-group backend refuses a process whose Neuron runtime is already initialised, and sets
  NEURON_RT_VISIBLE_CORES from LOCAL_RANK (and NEURON_RT_ROOT_COMM_ID) before the runtime starts: the first use of
  the device initialises the runtime, which without NEURON_RT_VISIBLE_CORES takes every core of the host;
- `torch.compile(backend="neuron")` rejects dynamic=True and keeps what it compiles in TORCH_NEURONX_NEFF_CACHE_DIR
  (default /tmp/neuron_backend... here: the variable must be set or the stand-in's default under /tmp is used),
  a graph found there is loaded instead of compiled.
What it cannot do: hold tensors. A PrivateUse1 device needs C++ kernels, so an op on `neuron` fails with PyTorch's
own "Could not run 'aten::...' with arguments from the 'neuron' backend" error.

Every event goes as one JSON line to $TORCHNEURON_STANDIN_LOG (when set), for the tests to read.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import types

import torch
import torch.distributed as dist

CORES_ON_THE_HOST = int(os.environ.get("TORCHNEURON_STANDIN_CORES", "8"))
_state = {"runtime_cores": None, "process_group": False}


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
    return _state["runtime_cores"]


def _device_module() -> types.ModuleType:
    module = types.ModuleType("torch.neuron")
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
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _neff_dir() -> str:
    return os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR") or "/tmp/neuron_backend/neff_cache"


def _compile(gm: torch.fx.GraphModule, example_inputs: list):
    """The `neuron` torch.compile backend: static shapes only; a graph's NEFF is looked up in the cache directory
    first, compiled (written) when absent. The graph then runs as traced (the stand-in has no device)."""
    symbolic = [x for x in example_inputs if isinstance(x, torch.SymInt)]
    symbolic += [x for x in example_inputs if isinstance(x, torch.Tensor) and any(
        isinstance(s, torch.SymInt) for s in x.shape)]  # fmt: skip
    if symbolic:
        _log("refused dynamic")
        raise RuntimeError("TorchNeuron stand-in: dynamic=True is rejected (dynamic shapes are not supported)")
    shapes = [list(x.shape) if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs]
    key = hashlib.sha256((gm.code + json.dumps(shapes)).encode()).hexdigest()[:20]
    path = os.path.join(_neff_dir(), f"MODULE_{key}", "graph.neff")
    if os.path.isfile(path):
        _log("neff loaded", key=key)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(gm.code)
        _log("neff compiled", key=key)
    return gm.forward


def _register() -> None:
    if torch._C._get_privateuse1_backend_name() != "neuron":
        torch.utils.rename_privateuse1_backend("neuron")
        torch._register_device_module("neuron", _device_module())
        dist.Backend.register_backend("neuron", _create_process_group, devices=["cpu"])
        from torch._dynamo import register_backend

        register_backend(_compile, name="neuron")
    _log("imported", argv=sys.argv[:3])


_register()
