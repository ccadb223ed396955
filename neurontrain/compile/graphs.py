"""The pending (not yet executed) XLA graph of a step: its HLO and a content hash of it.

The outputs of a sync are the live tensors with pending work, ordered by tensor id; given the same
tensors, `_get_xla_tensors_hlo` returns byte for byte the module the sync compiles (checked against
XLA_SAVE_TENSORS_FILE dumps in tests/integration/test_precompile.py).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

import torch

_MODULE_NAME = re.compile(r"^HloModule [^\s,]+", re.MULTILINE)


def pending_outputs(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    import torch_xla

    candidates = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla"]
    if not candidates:
        return []
    need = torch_xla._XLAC._check_tensor_need_materialization(candidates)
    by_id: dict[int, torch.Tensor] = {}
    for tensor, pending in zip(candidates, need):
        if pending:
            by_id.setdefault(torch_xla._XLAC._xla_get_tensor_id(tensor), tensor)
    return [by_id[k] for k in sorted(by_id)]


def graph_hlo(tensors: Iterable[torch.Tensor]) -> tuple[str, bytes]:
    """(HLO text, serialized HloModuleProto) of the graph a sync would compile for these tensors."""
    import torch_xla

    outputs = pending_outputs(tensors)
    if not outputs:
        return "", b""
    return torch_xla._XLAC._get_xla_tensors_hlo(outputs), torch_xla._XLAC._get_xla_tensors_hlo_proto(outputs)


def graph_id(hlo_text: str) -> str:
    """Content hash of a graph: SHA-256 of its HLO text with the module's process-local name removed."""
    canonical = _MODULE_NAME.sub("HloModule graph", hlo_text, count=1).rstrip() + "\n"
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]
