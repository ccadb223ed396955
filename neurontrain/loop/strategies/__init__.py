"""How a run's parameters are stepped, reduced over the workers and saved: the `Strategy` interface (`base.py`),
replicated AdamW (`replicated.py`, the reference the others subclass), ZeRO-1 (`zero1.py`), tensor parallel
(`tensor_parallel.py`), native DDP (`native_ddp.py`) and FSDP2 (`native_fsdp.py`); `build_strategy` picks one
from the plan (`select.py`)."""

from neurontrain.loop.strategies.base import Strategy
from neurontrain.loop.strategies.native_ddp import NativeDDP
from neurontrain.loop.strategies.native_fsdp import NativeFSDP
from neurontrain.loop.strategies.replicated import Replicated
from neurontrain.loop.strategies.select import build_strategy
from neurontrain.loop.strategies.tensor_parallel import TensorParallelAdamW
from neurontrain.loop.strategies.zero1 import HostZero1, InGraphZero1

__all__ = [
    "HostZero1",
    "InGraphZero1",
    "NativeDDP",
    "NativeFSDP",
    "Replicated",
    "Strategy",
    "TensorParallelAdamW",
    "build_strategy",
]
