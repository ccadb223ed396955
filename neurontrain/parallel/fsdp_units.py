"""What FSDP2 shards and torch.compile compiles one by one on the native backend: the model's transformer layers.

FSDP2 (`fully_shard`) gathers a unit's parameters in a hook before its forward and frees them after; a graph
compiled across such hooks breaks at each of them (measured: the whole tiny Llama compiled under FSDP2 gave 6
graphs per shape instead of 1). So each layer is its own FSDP2 unit and its own compiled function, as PyTorch's
own FSDP2 + torch.compile recipe (TorchTitan) does: one graph per layer and planned shape, with the gathers
between the graphs. The layers of a Hugging Face model are its longest `nn.ModuleList` of one module class
(Llama's `model.layers`, BERT's `encoder.layer`); what lies outside them (embeddings, final norm, head, loss)
belongs to the root unit and runs eagerly.
"""

from __future__ import annotations

import torch

from neurontrain.errors import UsageError


def transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated layers: its longest `nn.ModuleList` whose modules are all of one class (the first
    such list when two are as long). UsageError when the model has none."""
    best: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best):
            if len({type(child) for child in module}) == 1:
                best = list(module)
    if not best:
        raise UsageError(
            f"parallel.fsdp: {type(model).__name__} has no list of repeated layers to shard one by one (FSDP2 "
            "and torch.compile take one layer at a time)"
        )
    return best


def planned_graph_count(keys: int, layers: int, fsdp: bool) -> int:
    """Graphs a run compiles on the native backend: one per planned key for the whole compiled model, or one
    per key and layer when each layer compiles on its own (FSDP2)."""
    return keys * (layers if fsdp else 1)
