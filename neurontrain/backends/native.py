"""The native backend: `torch.compile` on a device target (no torch-xla), and what TorchDynamo reports.

A target (`NativeTarget`: device type, torch.compile backend, process-group backend) is data: one
`NativeBackend` runs on any of them.

Targets (`TARGETS`): the CPU and CUDA with inductor, TorchNeuron's PrivateUse1 device `neuron` with
`backend="neuron"` (Neuron's documentation: "TorchNeuron integrates through PyTorch's standard PrivateUse1 device
backend mechanism"), chosen by `hosts.native_device_type()`: TorchNeuron is torch-neuronx 2.13.x / 2.14.x by
Neuron's version rule. The TorchNeuron target is written to that documented contract and unverified here: there
is no trn2/trn3 host on this machine (tests/standin/torchneuron stands in for it).

Nothing here imports torch_xla. Graph counts, recompile reasons and graph breaks come from TorchDynamo's own
records (`torch._dynamo.utils.counters` and `guard_failures`), read as differences since the last reading.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

from neurontrain.backends.base import Backend
from neurontrain.backends.hosts import native_device_type, neuron_stack
from neurontrain.backends.names import neuron_devices
from neurontrain.errors import UsageError

NEURON_DEVICE = "neuron"  # TorchNeuron's PrivateUse1 device and its torch.compile backend share the name


@dataclass(frozen=True)
class NativeTarget:
    """Where the native backend runs: a torch device type, the torch.compile backend for it, its process-group
    backend, and the runtime's rules: `process_group_first` (the device may be touched only after
    init_process_group, which assigns each worker its cores: TorchNeuron) and the default of `fullgraph`."""

    device_type: str
    compiler: str
    collectives: str
    process_group_first: bool = False
    fullgraph: bool = False
    # each local worker addresses device LOCAL_RANK of all it sees (CUDA); else device 0 of what the runtime gave
    # it (TorchNeuron: its process group narrows each worker's NEURON_RT_VISIBLE_CORES to its own cores)
    per_local_rank: bool = False


CPU_TARGET = NativeTarget("cpu", "inductor", "gloo")
CUDA_TARGET = NativeTarget("cuda", "inductor", "nccl", per_local_rank=True)
# TorchNeuron's docs: torch.compile(backend="neuron") with fullgraph=True recommended, the `neuron` process group
NEURON_TARGET = NativeTarget(NEURON_DEVICE, NEURON_DEVICE, NEURON_DEVICE, process_group_first=True, fullgraph=True)
TARGETS = {t.device_type: t for t in (CPU_TARGET, CUDA_TARGET, NEURON_TARGET)}  # by hosts.native_device_type()


def torchneuron_host() -> bool:
    """Whether TorchNeuron is installed: torch-neuronx 2.13.x / 2.14.x by Neuron's version rule (hosts.py)."""
    return neuron_stack() == "torchneuron"


def native_target() -> NativeTarget:
    """The target of this host's device (hosts.native_device_type); on TorchNeuron, importing torch_neuronx
    registers its device, which must then be PyTorch's PrivateUse1 device `neuron`."""
    if neuron_stack() == "xla" and neuron_devices():
        raise UsageError(
            "backend native: the torch-neuronx installed here is the torch-xla one (trn1); use --backend neuron, "
            "or install TorchNeuron (trn2/trn3: torch-neuronx 2.13 / 2.14)"
        )
    target = TARGETS[native_device_type()]
    if target is not NEURON_TARGET:
        return target
    import torch
    import torch_neuronx  # noqa: F401  # lazy: present only on TorchNeuron hosts; registers the neuron device

    backend_name = torch._C._get_privateuse1_backend_name()
    if backend_name != NEURON_DEVICE:
        raise UsageError(
            f"backend native: torch_neuronx imported but PyTorch's PrivateUse1 device is {backend_name!r}, not "
            f"{NEURON_DEVICE!r}"
        )
    return target


def visible_cores(value: str | None) -> int | None:
    """NeuronCores in NEURON_RT_VISIBLE_CORES ("3", "0-3", "0,1,4-5"); None when unset (pure)."""
    if not value:
        return None
    count = 0
    for part in value.split(","):
        low, _, high = part.strip().partition("-")
        count += int(high or low) - int(low) + 1
    return count


def compile_in_place(
    model: Any, compiler: str, planned_graphs: int, units: list | None = None, fullgraph: bool = False
) -> None:
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
        module.compile(backend=compiler, dynamic=False, fullgraph=fullgraph)


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

    def __init__(self, target: NativeTarget, compiler_flags: list[str], fullgraph: bool | None = None) -> None:
        super().__init__("native", target.collectives, False, compiler_flags, compiler=target.compiler)
        self.target = target
        self.fullgraph = target.fullgraph if fullgraph is None else fullgraph
        self._dynamo = DynamoRecords()

    @property
    def native_device(self) -> str:
        """The target's torch device type ("cpu" here, "neuron" on TorchNeuron)."""
        return self.target.device_type

    def _make_device(self) -> Any:
        import torch

        if self.target.device_type == "cpu":
            return torch.device("cpu")
        if not self.target.per_local_rank:
            return torch.device(self.target.device_type, 0)
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.accelerator.set_device_index(index)  # the current device, which NCCL's communicators use
        return torch.device(self.target.device_type, index)

    def compile_model(self, model: Any, planned_graphs: int, units: list | None = None) -> None:
        """Compile the model in place (`nn.Module.compile`, static shapes), or each of `units` (FSDP2's layers)."""
        compile_in_place(model, self.target.compiler, planned_graphs, units, self.fullgraph)

    def compile_notes(self) -> list[str]:
        """TorchDynamo's recompile reasons and graph breaks since the last call."""
        return self._dynamo.notes()

    def compile_count(self) -> int:
        """TorchDynamo's graphs in this process."""
        return self._dynamo.graphs()

    def compile_seconds(self) -> float:
        return self._dynamo.seconds()

    def device_count(self) -> int:
        """Devices this worker addresses. TorchNeuron: the cores its process group gave this worker
        (NEURON_RT_VISIBLE_CORES, set from LOCAL_RANK at init_process_group), else what torch counts."""
        if self.target.device_type == "cpu":
            return super().device_count()
        cores = visible_cores(os.environ.get("NEURON_RT_VISIBLE_CORES")) if self.target is NEURON_TARGET else None
        if cores is not None:
            return cores
        import torch

        return torch.accelerator.device_count()


def select_native(compiler_flags: list[str], fullgraph: bool | None = None) -> NativeBackend:
    """`torch.compile` on this host's device target (never through torch-xla: transformers is told not to import
    it either, through its USE_TORCH_XLA flag). TorchNeuron reads neuronx-cc flags from NEURON_CC_FLAGS itself:
    compiler_flags are appended there."""
    os.environ["USE_TORCH_XLA"] = "0"
    target = native_target()
    if target is NEURON_TARGET and compiler_flags:
        os.environ["NEURON_CC_FLAGS"] = " ".join([os.environ.get("NEURON_CC_FLAGS", ""), *compiler_flags]).strip()
    return NativeBackend(target, compiler_flags, fullgraph)
