"""The torch-xla runtimes: Neuron (torch-neuronx), XLA:CPU and XLA:CUDA. Lazy tensors: a step's ops build one
graph, cut and launched at `sync`; compile counts and host transfers go through torch-xla's own calls."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from neurontrain.backends.base import Backend
from neurontrain.backends.names import neuron_available
from neurontrain.errors import UsageError


class XlaBackend(Backend):
    is_xla: ClassVar[bool] = True

    def _make_device(self) -> Any:
        import torch_xla  # lazy: importing torch_xla starts a runtime

        return torch_xla.device()

    def sync(self) -> None:
        """Cut the pending graph and launch it; torch-xla runs the step closures after it."""
        import torch_xla  # lazy: see _make_device

        torch_xla.sync()

    def add_step_closure(self, fn: Callable, args: tuple = ()) -> None:
        import torch_xla.core.xla_model as xm  # lazy: see _make_device

        xm.add_step_closure(fn, args=args)

    def wrap_loader(self, batches: Iterable, loader: str) -> Iterable:
        if loader == "mp_device_loader":
            import torch_xla.distributed.parallel_loader as pl  # lazy: see _make_device

            return pl.MpDeviceLoader(batches, self.device)
        return super().wrap_loader(batches, loader)

    def compile_count(self) -> int:
        """XLA's compiles in this process."""
        data = _compile_time()
        return int(data[0]) if data else 0

    def compile_seconds(self) -> float:
        data = _compile_time()
        return float(data[1]) / 1e9 if data else 0.0

    def execute_count(self) -> int:
        import torch_xla.debug.metrics as met  # lazy: see _make_device

        return int(met.counter_value("ExecuteComputation") or 0)

    def _autocast_device_type(self) -> str:
        return "xla"

    def to_host(self, tensors: list) -> list:
        """In one transfer (the tensors must already be computed: after a sync)."""
        import torch_xla  # lazy: see _make_device

        return torch_xla._XLAC._xla_get_cpu_tensors(tensors)

    def to_device(self, tensors: list) -> list:
        """In one transfer."""
        import torch_xla.core.xla_model as xm  # lazy: see _make_device

        return xm.send_cpu_data_to_device(tensors, self.device)

    def save(self, obj: Any, path: str) -> None:
        """xm.save semantics: tensors moved to CPU, master only."""
        import torch_xla.core.xla_model as xm  # lazy: see _make_device

        xm.save(obj, path, master_only=True, global_master=True)

    def rng_state(self) -> Any:
        import torch_xla.core.xla_model as xm  # lazy: see _make_device

        return int(xm.get_rng_state())

    def set_rng_state(self, state: Any) -> None:
        if state is None:
            return
        import torch_xla.core.xla_model as xm  # lazy: see _make_device

        xm.set_rng_state(int(state))

    def seed_graph(self, seed: int) -> None:
        """Seed what the next graph draws: the XLA device's RNG."""
        self.set_rng_state(seed)

    def device_count(self) -> int:
        import torch_xla.runtime as xr  # lazy: see _make_device

        return xr.addressable_runtime_device_count()


def _compile_time() -> Any:
    import torch_xla.debug.metrics as met  # lazy: see XlaBackend._make_device

    return met.metric_data("CompileTime")


def _xla_library() -> str | None:
    spec = importlib.util.find_spec("_XLAC")
    return spec.origin if spec is not None else None


def check_xla_flags(flags: list[str], library: str | None = None) -> None:
    """XLA aborts the process on a flag it does not know: check each against the flag names compiled into
    torch-xla's XLA library before XLA sees them (UsageError, one line)."""
    import mmap
    import re

    for flag in flags:
        match = re.fullmatch(r"--(xla_[a-z0-9_]+)(=.*)?", flag)
        if not match:
            raise UsageError(
                f"runtime.xla_flags: {flag!r} is not an XLA flag (expected --xla_<name>[=value]; "
                "neuronx-cc flags belong in runtime.compiler_flags)"
            )
    library = library or _xla_library()
    if not flags or library is None:
        return
    with open(library, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as image:
        for flag in flags:
            name = flag[2:].split("=", 1)[0].encode()
            if image.find(b"\0" + name + b"\0") < 0 and image.find(b"--" + name + b"\0") < 0:
                raise UsageError(f"runtime.xla_flags: XLA has no flag --{name.decode()} (checked against {library})")


def select_xla(name: str, compiler_flags: list[str], xla_flags: list[str]) -> XlaBackend:
    """compiler_flags are neuronx-cc flags: the Neuron runtime receives them (compile/neuron_runtime.py), XLA
    never does. xla_flags are checked, then appended to XLA_FLAGS on XLA:CPU and XLA:CUDA."""
    if name == "neuron":
        if not neuron_available():
            raise UsageError("backend neuron needs torch-neuronx installed and /dev/neuron* devices")
        return XlaBackend(name, "xla", True, compiler_flags)
    if importlib.util.find_spec("torch_xla") is None:
        raise UsageError(f"backend {name} needs torch-xla (pip install torch-xla==2.9.0)")
    os.environ["PJRT_DEVICE"] = "CPU" if name == "xla-cpu" else "CUDA"
    if xla_flags:
        check_xla_flags(list(xla_flags))
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + list(xla_flags)).strip()
    # XLA:CPU writes serialized executables but cannot load them back (measured): compiles repeat per run.
    return XlaBackend(name, "gloo" if name == "xla-cpu" else "xla", name == "xla-cuda", compiler_flags)
