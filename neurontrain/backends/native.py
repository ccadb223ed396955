"""The native backend: `torch.compile` on a device target (no torch-xla), and what TorchDynamo reports.

A target (`NativeTarget`: device type, torch.compile backend, process-group backend) is data: one
`NativeBackend` runs on any of them.

On this machine the native backend is the CPU device with `torch.compile(backend="inductor", dynamic=False)`.
On a TorchNeuron host (trn2/trn3) it is PyTorch's PrivateUse1 device `neuron` with `backend="neuron"`.
TorchNeuron is installed as the `torch-neuronx` distribution (import name `torch_neuronx`), the same name as
the torch-xla-based package of trn1: `torchneuron_host` tells them apart by the distribution's requirements
(the torch-xla one requires torch-xla) and, once imported, by PyTorch's PrivateUse1 backend name, which
TorchNeuron renames to `neuron` (Neuron's documentation: "TorchNeuron integrates through PyTorch's standard
PrivateUse1 device backend mechanism"; device `neuron`, `torch.compile(model, backend="neuron")`). Written to
that documented contract and unverified here: there is no trn2/trn3 host on this machine.

Nothing here imports torch_xla. Graph counts, recompile reasons and graph breaks come from TorchDynamo's own
records (`torch._dynamo.utils.counters` and `guard_failures`), read as differences since the last reading.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, ClassVar

from neurontrain.backends.base import Backend
from neurontrain.backends.names import neuron_devices
from neurontrain.errors import UsageError

NEURON_DEVICE = "neuron"  # TorchNeuron's PrivateUse1 device and its torch.compile backend share the name


@dataclass(frozen=True)
class NativeTarget:
    """Where the native backend runs: a torch device type and the torch.compile backend for it."""

    device_type: str
    compiler: str
    collectives: str  # the torch.distributed process-group backend for this device (data parallel: phase 2)


CPU_TARGET = NativeTarget("cpu", "inductor", "gloo")
NEURON_TARGET = NativeTarget(NEURON_DEVICE, NEURON_DEVICE, NEURON_DEVICE)


def _requires_torch_xla(distribution: str) -> bool:
    try:
        requirements = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return False
    return any(r.replace("_", "-").lower().startswith("torch-xla") for r in requirements)


def torchneuron_host(neuron_devices: list[str]) -> bool:
    """Whether this is a TorchNeuron host: `torch_neuronx` importable, Neuron devices present, and that
    `torch-neuronx` is not the torch-xla-based one (UsageError: that one serves `--backend neuron`)."""
    if importlib.util.find_spec("torch_neuronx") is None or not neuron_devices:
        return False
    if _requires_torch_xla("torch-neuronx"):
        raise UsageError(
            "backend native: the torch-neuronx installed here is the torch-xla one (trn1); use --backend neuron, "
            "or install TorchNeuron (trn2/trn3)"
        )
    return True


def native_target(neuron_devices: list[str]) -> NativeTarget:
    """NEURON_TARGET on a TorchNeuron host (importing torch_neuronx registers its device), else CPU_TARGET."""
    if not torchneuron_host(neuron_devices):
        return CPU_TARGET
    import torch
    import torch_neuronx  # noqa: F401  # lazy: present only on TorchNeuron hosts; registers the neuron device

    backend_name = torch._C._get_privateuse1_backend_name()
    if backend_name != NEURON_DEVICE:
        raise UsageError(
            f"backend native: torch_neuronx imported but PyTorch's PrivateUse1 device is {backend_name!r}, not "
            f"{NEURON_DEVICE!r}"
        )
    return NEURON_TARGET


def compile_in_place(model: Any, compiler: str, planned_graphs: int, units: list | None = None) -> None:
    """`nn.Module.compile` with static shapes: the module keeps its class and state_dict names (checkpoints,
    the `model/` export and `checkpoint migrate` see the same names as on the other backends). units: compile
    these submodules one by one instead of the whole model (FSDP2's units: `parallel/fsdp_units.py`). Dynamo
    keeps up to `recompile_limit` graphs per function and silently runs the rest eagerly: the limit is raised to
    the plan's number of graphs so a planned graph is never dropped (layers of one class share their function)."""
    import torch._dynamo  # lazy: TorchDynamo loads in seconds and only the native backend uses it

    if compiler == "inductor":
        require_cpp_compiler()
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, planned_graphs + 1)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, planned_graphs + 1)
    for module in units if units is not None else [model]:
        module.compile(backend=compiler, dynamic=False)


def require_cpp_compiler() -> None:
    """Inductor compiles C++ for the CPU: without a compiler it fails at the first step with a long traceback.
    Asks inductor's own compiler search (the CXX it is configured with, else g++) before anything compiles."""
    from torch._inductor import cpp_builder, exc  # lazy: see compile_in_place

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        raise UsageError(
            "backend native on CPU: inductor found no C++ compiler (it looks for g++, or the one "
            "torch._inductor.config.cpp.cxx names); install g++"
        ) from None


@dataclass
class DynamoRecords:
    """Differences in TorchDynamo's records since the last `notes()`: graphs compiled, why it recompiled, where
    the graph broke. Compile time is TorchDynamo's own timing of its frame compiles and of the backward
    graphs compiled in the first backward pass."""

    _reasons_seen: dict = field(default_factory=dict)  # compiled code -> its guard failures already reported
    _breaks_seen: Counter = field(default_factory=Counter)

    @staticmethod
    def graphs() -> int:
        from torch._dynamo.utils import counters  # lazy: see compile_in_place

        return int(counters["stats"]["unique_graphs"])

    @staticmethod
    def seconds() -> float:
        from torch._dynamo.utils import compilation_time_metrics  # lazy: see compile_in_place

        timed = ("_compile.compile_inner", "backward._backward_impl")
        return float(sum(sum(compilation_time_metrics.get(name, [])) for name in timed))

    def notes(self) -> list[str]:
        """Recompile reasons (guard failures) and graph breaks (with their reason) new since the last call."""
        from torch._dynamo.utils import counters, guard_failures  # lazy: see compile_in_place

        out = []
        for code, failures in list(guard_failures.items()):
            out += [f"recompiled: {reason}" for reason in failures[self._reasons_seen.get(code, 0) :]]
            self._reasons_seen[code] = len(failures)
        breaks = Counter(counters["graph_break"])
        out += [f"graph break: {reason}" for reason in sorted(breaks - self._breaks_seen)]
        self._breaks_seen = breaks
        return out


class NativeBackend(Backend):
    """`torch.compile` (static shapes) on `target`'s device: compiled graphs run when called, so step closures
    run at the next sync as on eager."""

    is_native: ClassVar[bool] = True
    collectives_on_device: ClassVar[bool] = True

    def __init__(self, target: NativeTarget, compiler_flags: list[str]) -> None:
        super().__init__("native", target.collectives, False, compiler_flags, compiler=target.compiler)
        self.target = target
        self._dynamo = DynamoRecords()

    @property
    def native_device(self) -> str:
        """The target's torch device type ("cpu" here, "neuron" on TorchNeuron)."""
        return self.target.device_type

    def _make_device(self) -> Any:
        import torch

        if self.target.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.target.device_type, int(os.environ.get("LOCAL_RANK", 0)))

    def compile_model(self, model: Any, planned_graphs: int, units: list | None = None) -> None:
        """Compile the model in place (`nn.Module.compile`, static shapes), or each of `units` (FSDP2's layers)."""
        compile_in_place(model, self.target.compiler, planned_graphs, units)

    def compile_notes(self) -> list[str]:
        """TorchDynamo's recompile reasons and graph breaks since the last call."""
        return self._dynamo.notes()

    def compile_count(self) -> int:
        """TorchDynamo's graphs in this process."""
        return self._dynamo.graphs()

    def compile_seconds(self) -> float:
        return self._dynamo.seconds()

    def device_count(self) -> int:
        if self.target.device_type == "cpu":
            return super().device_count()
        import torch

        return torch.accelerator.device_count()


def select_native(compiler_flags: list[str]) -> NativeBackend:
    """`torch.compile` on the CPU, or on TorchNeuron's `neuron` device where that is installed (never through
    torch-xla: transformers is told not to import it either, through its USE_TORCH_XLA flag)."""
    os.environ["USE_TORCH_XLA"] = "0"
    return NativeBackend(native_target(neuron_devices()), compiler_flags)
