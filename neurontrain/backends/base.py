"""The interface every runtime implements (`xla.py`, `native.py`, `eager.py`), with the defaults of the runtimes
that run a step's ops as they are called (eager, native): step closures run at the next `sync`, tensors move one
by one, `torch.save`, torch's own generators.

Nothing is imported or initialised at construction: the device is made on first use.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from neurontrain.backends.names import neuron_devices


class Backend:
    """A runtime: its device, how a step's graph is cut and run, what it compiled, and its host transfers."""

    is_xla: ClassVar[bool] = False  # runs through torch-xla: lazy tensors, a graph cut at each sync
    is_native: ClassVar[bool] = False  # `torch.compile` on a native device target
    collectives_on_device: ClassVar[bool] = False  # workers' process group reduces device tensors (else host gloo)

    def __init__(
        self,
        name: str,
        collectives: str,
        reloads_executables: bool,
        compiler_flags: list[str] | None = None,
        compiler: str | None = None,
    ) -> None:
        self.name = name
        self.collectives = collectives
        self.reloads_executables = reloads_executables
        self.compiler_flags = list(compiler_flags or [])
        self.compiler = compiler  # the torch.compile backend (native only)
        self._device: Any = None
        self._closures: list = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @property
    def device(self) -> Any:
        if self._device is None:
            self._device = self._make_device()
        return self._device

    def _make_device(self) -> Any:
        import torch

        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def process_group(self) -> str:
        """The torch.distributed backend its workers rendezvous with: the device's own where collectives run on
        device tensors, else gloo on host copies."""
        return self.collectives if self.collectives_on_device else "gloo"

    def sync(self) -> None:
        """End the step: run the step closures queued since the last sync (their tensors hold values)."""
        closures, self._closures = self._closures, []
        for fn, args in closures:
            fn(*args)

    def add_step_closure(self, fn: Callable, args: tuple = ()) -> None:
        """Run fn(*args) after the next sync, when its tensors hold values: no host sync inside the step."""
        self._closures.append((fn, args))

    def wrap_loader(self, batches: Iterable, loader: str) -> Iterable:
        return MovingLoader(batches, self.device)

    def compile_model(self, model: Any, planned_graphs: int, units: list | None = None) -> None:
        """Compile the model ahead of its first step where the runtime does (native); nothing by default."""

    def compile_notes(self) -> list[str]:
        """Recompile reasons and graph breaks since the last call (native); none by default."""
        return []

    def compile_count(self) -> int:
        """Graphs compiled in this process."""
        return 0

    def compile_seconds(self) -> float:
        return 0.0

    def execute_count(self) -> int:
        return 0

    def autocast(self, precision: str) -> contextlib.AbstractContextManager:
        if precision != "bf16":
            return contextlib.nullcontext()
        import torch

        return torch.autocast(self._autocast_device_type(), dtype=torch.bfloat16)

    def _autocast_device_type(self) -> str:
        return self.device.type

    def to_host(self, tensors: list) -> list:
        """Copies on the host (the tensors must already be computed: after a sync)."""
        return [t.detach().cpu() for t in tensors]

    def to_device(self, tensors: list) -> list:
        """Host tensors as device data (graph inputs, not constants)."""
        return [t.to(self.device) for t in tensors]

    def save(self, obj: Any, path: str) -> None:
        import torch

        torch.save(obj, path)

    def rng_state(self) -> Any:
        import torch

        return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def set_rng_state(self, state: Any) -> None:
        if state is None:
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state)

    def seed_graph(self, seed: int) -> None:
        """Seed what the next graph draws: torch's generators."""
        import torch

        torch.manual_seed(seed)

    def device_count(self) -> int:
        """Devices this worker can address."""
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 1

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


class MovingLoader:
    """Moves each batch's tensors to the device; non-tensor values pass through."""

    def __init__(self, batches: Iterable, device: Any) -> None:
        self.batches, self.device = batches, device

    def __iter__(self):
        for batch in self.batches:
            yield {k: (v.to(self.device) if hasattr(v, "to") else v) for k, v in batch.items()}
