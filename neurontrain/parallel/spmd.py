"""A CPU proxy for the tensor-parallel rules: the rules `checkpoint migrate` shards by (`rules.py`), written as
torch-xla SPMD sharding annotations, so a model can train sharded over virtual CPU devices
(`CPU_NUM_DEVICES=N`) and be compared with the unsharded run. SPMD is not supported on Neuron; it only checks
the rules here. Call `use_spmd()` before anything creates the XLA device (torch-xla crashes at the first sync
otherwise), and run each sharded job in its own process (SPMD mode is process-global).

The mesh has two axes, `copy` (M = TP / KV heads when TP is above the KV heads, else 1) and `kv` (TP / M),
device r at (r // (TP / M), r % (TP / M)). On it every rule places exactly the rows or columns `rules.shard`
gives rank r:
  vocab, column, gate, up  dim 0 over (copy, kv): rank r holds chunk r
  row                      dim 1 over (copy, kv)
  q                        dim 0 over (kv, copy): rank r holds the query heads of its KV head (Neuron's permutation)
  o                        dim 1 over (kv, copy), the columns of those query heads
  k, v                     dim 0 over kv, replicated over copy: rank r holds KV head r mod KV (the M copies)
  replicate                annotated as replicated (left unannotated, a tensor an optimizer step writes takes
                           the sharding XLA's propagation picks, which need not be the rule's)
What this checks: that the layout is one the model trains under with the same losses (XLA's partitioner inserts
the collectives NxD's layers would), and, by `placement_mismatches`, that each device's piece is the one
`rules.shard` gives its rank. What it does not check: NxD's own layers and collectives, fused QKV / gate_up
names, vocabulary padding (the proxy needs TP to divide the vocabulary), pipeline stages.
"""

from __future__ import annotations

from typing import Any

import torch

from neurontrain.errors import UsageError
from neurontrain.parallel.rules import ShardingSpec, rule_for, shard

TP_AXES = ("copy", "kv")
_SPLIT_DIM = {"vocab": 0, "column": 0, "gate": 0, "up": 0, "row": 1, "q": 0, "o": 1, "k": 0, "v": 0}
_AXES = {"q": ("kv", "copy"), "o": ("kv", "copy"), "k": "kv", "v": "kv"}


def mesh_shape(spec: ShardingSpec) -> tuple[int, int]:
    """(copy, kv) axis sizes for spec.tp devices."""
    return spec.kv_multiplier, spec.tp // spec.kv_multiplier


def partition_spec(spec: ShardingSpec, rule: str, ndim: int) -> tuple:
    """The `xs.mark_sharding` partition spec of a tensor under `rule` (all None: replicated)."""
    if rule == "replicate":
        return (None,) * ndim
    if spec.vocab_padding:
        raise UsageError(f"the SPMD proxy needs --tp {spec.tp} to divide the vocabulary ({spec.vocab_size})")
    if rule not in _SPLIT_DIM:
        raise UsageError(f"the SPMD proxy has no annotation for rule {rule!r} (fused or Conv1D tensors)")
    dim = _SPLIT_DIM[rule]
    if dim >= ndim:
        raise UsageError(f"rule {rule!r} splits dim {dim} of a {ndim}-dimensional tensor")
    axes: list = [None] * ndim
    axes[dim] = _AXES.get(rule, TP_AXES)
    return tuple(axes)


def use_spmd() -> None:
    """Switch this process to SPMD; before anything creates the XLA device."""
    import torch_xla.runtime as xr  # lazy: importing torch_xla starts a runtime

    xr.use_spmd()


def make_mesh(spec: ShardingSpec) -> Any:
    import numpy as np  # lazy: only the proxy needs it
    import torch_xla.distributed.spmd as xs  # lazy: importing torch_xla starts a runtime
    import torch_xla.runtime as xr  # lazy: as above

    devices = xr.global_runtime_device_count()
    if devices != spec.tp:
        raise UsageError(f"the SPMD proxy for tp {spec.tp} needs {spec.tp} devices (CPU_NUM_DEVICES), found {devices}")
    return xs.Mesh(np.arange(spec.tp), mesh_shape(spec), TP_AXES)


def mark(tensor: torch.Tensor, mesh: Any, spec: ShardingSpec, rule: str) -> None:
    import torch_xla.distributed.spmd as xs  # lazy: importing torch_xla starts a runtime

    xs.mark_sharding(tensor, mesh, partition_spec(spec, rule, tensor.dim()))


def mark_model(model: torch.nn.Module, mesh: Any, spec: ShardingSpec, optimizer: Any = None) -> dict[str, str]:
    """Annotate every parameter (and its gradient and optimizer state, once they exist: unannotated they come
    back replicated after a step) by its rule; returns name -> rule."""
    rules = {}
    for name, param in model.named_parameters():
        rule = rules[name] = rule_for(spec, name)
        state = optimizer.state.get(param, {}) if optimizer is not None else {}
        tensors = [param, param.grad, *(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim())]
        for tensor in tensors:
            if tensor is not None:
                mark(tensor, mesh, spec, rule)
    return rules


def placement_mismatches(model: torch.nn.Module, spec: ShardingSpec, full: dict[str, torch.Tensor]) -> list[str]:
    """Parameters where some device's piece (as the runtime placed it) is not `rules.shard`'s piece for that
    rank, computed from `full`, the unsharded values."""
    import torch_xla  # lazy: importing torch_xla starts a runtime

    wrong = []
    for name, param in model.named_parameters():
        rule = rule_for(spec, name)
        pieces = torch_xla._XLAC._get_local_shards([param])[0]  # (tensor, "CPU:<device>") per device
        for piece, device in pieces:
            expected = shard(spec, rule, full[name], rank(device))
            if piece.shape != expected.shape or not torch.equal(piece, expected):
                wrong.append(f"{name} on {device}")
    return wrong


def rank(device: str) -> int:
    """The TP rank of a device named `CPU:<n>` (the mesh lists devices in rank order)."""
    return int(device.rsplit(":", 1)[1])
