"""Which runtime we are on (Neuron, XLA:CPU, XLA:CUDA, native `torch.compile`, or eager PyTorch) and what it can
do.

Nothing is imported or initialised at import time: `select_backend()` does the work.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from neurontrain.errors import UsageError
from neurontrain.native import DynamoRecords, compile_in_place, native_target

BACKENDS = ("neuron", "xla-cpu", "xla-cuda", "native", "eager")
XLA_BACKENDS = ("neuron", "xla-cpu", "xla-cuda")


def is_xla_backend(name: str) -> bool:
    """Whether a backend name (after `resolve_backend_name`) runs through torch-xla."""
    return name in XLA_BACKENDS


def neuron_devices() -> list[str]:
    return sorted(glob.glob("/dev/neuron[0-9]*"))


def neuron_available() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None and bool(neuron_devices())


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


@dataclass
class Backend:
    name: str
    collectives: str
    reloads_executables: bool
    compiler_flags: list[str] = field(default_factory=list)
    compiler: str | None = None  # native: the torch.compile backend ("inductor" here, "neuron" on TorchNeuron)
    native_device: str | None = None  # native: the torch device type ("cpu" here, "neuron" on TorchNeuron)
    _device: Any = None
    _closures: list = field(default_factory=list)
    _dynamo: DynamoRecords = field(default_factory=DynamoRecords)

    @property
    def is_xla(self) -> bool:
        return is_xla_backend(self.name)

    @property
    def is_native(self) -> bool:
        return self.name == "native"

    @property
    def device(self) -> Any:
        if self._device is None:
            import torch

            if self.is_xla:
                import torch_xla

                self._device = torch_xla.device()
            elif self.is_native and self.native_device != "cpu":
                self._device = torch.device(self.native_device, int(os.environ.get("LOCAL_RANK", 0)))
            elif self.is_native:
                self._device = torch.device("cpu")
            else:
                self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return self._device

    def sync(self) -> None:
        """Cut the graph and launch it (XLA); on eager and native (whose compiled graphs run when called), run
        the step closures queued since the last sync."""
        if self.is_xla:
            import torch_xla

            torch_xla.sync()
        else:
            closures, self._closures = self._closures, []
            for fn, args in closures:
                fn(*args)

    def add_step_closure(self, fn: Callable, args: tuple = ()) -> None:
        """Run fn(*args) after the next sync, when its tensors hold values: no host sync inside the step."""
        if self.is_xla:
            import torch_xla.core.xla_model as xm

            xm.add_step_closure(fn, args=args)
        else:
            self._closures.append((fn, args))

    def wrap_loader(self, batches: Iterable, loader: str) -> Iterable:
        if self.is_xla and loader == "mp_device_loader":
            import torch_xla.distributed.parallel_loader as pl

            return pl.MpDeviceLoader(batches, self.device)
        return _MovingLoader(batches, self.device)

    def compile_model(self, model: Any, planned_graphs: int, units: list | None = None) -> None:
        """On native, compile the model in place (`nn.Module.compile`, static shapes), or each of `units` (FSDP2's
        layers); elsewhere nothing: XLA traces whatever runs, eager compiles nothing."""
        if self.is_native:
            compile_in_place(model, self.compiler, planned_graphs, units)

    def compile_notes(self) -> list[str]:
        """Native: TorchDynamo's recompile reasons and graph breaks since the last call; none elsewhere."""
        return self._dynamo.notes() if self.is_native else []

    def compile_count(self) -> int:
        """Graphs compiled in this process: XLA's compiles, TorchDynamo's graphs on native, none on eager."""
        if self.is_native:
            return self._dynamo.graphs()
        if not self.is_xla:
            return 0
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def compile_seconds(self) -> float:
        if self.is_native:
            return self._dynamo.seconds()
        if not self.is_xla:
            return 0.0
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return float(data[1]) / 1e9 if data else 0.0

    def execute_count(self) -> int:
        if not self.is_xla:
            return 0
        import torch_xla.debug.metrics as met

        return int(met.counter_value("ExecuteComputation") or 0)

    def autocast(self, precision: str) -> contextlib.AbstractContextManager:
        if precision != "bf16":
            return contextlib.nullcontext()
        import torch

        device_type = "xla" if self.is_xla else self.device.type
        return torch.autocast(device_type, dtype=torch.bfloat16)

    def to_host(self, tensors: list) -> list:
        """Copies on the host, in one transfer on XLA (the tensors must already be computed: after a sync)."""
        if self.is_xla:
            import torch_xla

            return torch_xla._XLAC._xla_get_cpu_tensors(tensors)
        return [t.detach().cpu() for t in tensors]

    def to_device(self, tensors: list) -> list:
        """Host tensors as device data (graph inputs, not constants), in one transfer on XLA."""
        if self.is_xla:
            import torch_xla.core.xla_model as xm

            return xm.send_cpu_data_to_device(tensors, self.device)
        return [t.to(self.device) for t in tensors]

    def save(self, obj: Any, path: str) -> None:
        """Save with xm.save semantics on XLA (tensors moved to CPU, master only)."""
        if self.is_xla:
            import torch_xla.core.xla_model as xm

            xm.save(obj, path, master_only=True, global_master=True)
        else:
            import torch

            torch.save(obj, path)

    def rng_state(self) -> Any:
        if self.is_xla:
            import torch_xla.core.xla_model as xm

            return int(xm.get_rng_state())
        import torch

        return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def set_rng_state(self, state: Any) -> None:
        if state is None:
            return
        if self.is_xla:
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(int(state))
        else:
            import torch

            if torch.cuda.is_available():
                torch.cuda.set_rng_state_all(state)

    def describe(self) -> dict:
        return {
            "backend": self.name,
            "device": str(self.device),
            "collectives": self.collectives,
            "reloads_compiled_executables": self.reloads_executables,
            "compiler_flags": self.compiler_flags,
            "torch_compile_backend": self.compiler,
            "pjrt_device": os.environ.get("PJRT_DEVICE"),
            "neuron_devices": neuron_devices(),
        }


class _MovingLoader:
    """Moves each batch's tensors to the device; non-tensor values pass through."""

    def __init__(self, batches: Iterable, device: Any) -> None:
        self.batches, self.device = batches, device

    def __iter__(self):
        for batch in self.batches:
            yield {k: (v.to(self.device) if hasattr(v, "to") else v) for k, v in batch.items()}


def neuron_runtime_present() -> bool:
    """Whether the Neuron runtime's compiler and compile cache (libneuronxla, part of torch-neuronx) is here."""
    return importlib.util.find_spec("libneuronxla") is not None


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


def select_backend(
    requested: str = "auto", compiler_flags: list[str] | None = None, xla_flags: list[str] | None = None
) -> Backend:
    """compiler_flags are neuronx-cc flags: the Neuron runtime receives them (compile/neuron_runtime.py), XLA
    never does. xla_flags are checked, then appended to XLA_FLAGS on the XLA backends."""
    name = resolve_backend_name(requested)
    flags = list(compiler_flags or [])
    if name == "neuron":
        if not neuron_available():
            raise UsageError("backend neuron needs torch-neuronx installed and /dev/neuron* devices")
        return Backend(name, "xla", True, flags)
    if name == "native":
        return native_backend(flags)
    if name in ("xla-cpu", "xla-cuda"):
        if importlib.util.find_spec("torch_xla") is None:
            raise UsageError(f"backend {name} needs torch-xla (pip install torch-xla==2.9.0)")
        os.environ["PJRT_DEVICE"] = "CPU" if name == "xla-cpu" else "CUDA"
        if xla_flags:
            check_xla_flags(list(xla_flags))
            os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + list(xla_flags)).strip()
        # XLA:CPU writes serialized executables but cannot load them back (measured): compiles repeat per run.
        return Backend(name, "gloo" if name == "xla-cpu" else "xla", name == "xla-cuda", flags)
    import torch

    return Backend("eager", "nccl" if torch.cuda.is_available() else "gloo", False, flags)


def native_backend(compiler_flags: list[str]) -> Backend:
    """`torch.compile` on the CPU, or on TorchNeuron's `neuron` device where that is installed (never through
    torch-xla: transformers is told not to import it either, through its USE_TORCH_XLA flag)."""
    os.environ["USE_TORCH_XLA"] = "0"
    target = native_target(neuron_devices())
    return Backend(
        "native",
        target.collectives,
        False,
        compiler_flags,
        compiler=target.compiler,
        native_device=target.device_type,
    )


def backend_for(runtime: Any) -> Backend:
    """The backend of a recipe's `runtime` section."""
    return select_backend(runtime.backend, list(runtime.compiler_flags), list(runtime.xla_flags))


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
