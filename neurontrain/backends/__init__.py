"""The runtimes a run can use, one `Backend` implementation each (`xla.py`, `native.py`, `eager.py`, over the
interface in `base.py`), chosen once by `select_backend` / `backend_for` (`select.py`); what a backend name alone
tells, for code that runs before a backend exists (`names.py`)."""

from neurontrain.backends.base import Backend
from neurontrain.backends.eager import EagerBackend
from neurontrain.backends.names import (
    BACKENDS,
    XLA_BACKENDS,
    is_xla_backend,
    neuron_available,
    neuron_devices,
    neuron_runtime_present,
    resolve_backend_name,
)
from neurontrain.backends.native import CPU_TARGET, NEURON_TARGET, NativeBackend, NativeTarget, native_target
from neurontrain.backends.select import backend_for, package_versions, select_backend
from neurontrain.backends.xla import XlaBackend, check_xla_flags

__all__ = [
    "BACKENDS",
    "CPU_TARGET",
    "NEURON_TARGET",
    "XLA_BACKENDS",
    "Backend",
    "EagerBackend",
    "NativeBackend",
    "NativeTarget",
    "XlaBackend",
    "backend_for",
    "check_xla_flags",
    "is_xla_backend",
    "native_target",
    "neuron_available",
    "neuron_devices",
    "neuron_runtime_present",
    "package_versions",
    "resolve_backend_name",
    "select_backend",
]
