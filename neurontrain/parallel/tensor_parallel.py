"""Tensor parallel on Neuron through neuronx-distributed (NxD): a Hugging Face Llama or BERT model's linear and
embedding layers replaced by NxD's parallel layers, chosen by the same rules `checkpoint migrate` shards by
(`rules.py`), and each rank's weights cut by the same `shard` function.

Which layer a module becomes follows from the rule of its weight:
  vocab       ParallelEmbedding (an embedding) or ColumnParallelLinear with gathered output (lm_head): dim 0
  column, q, k, v, gate, up    ColumnParallelLinear (gather_output=False): dim 0; its bias split with it
  row, o      RowParallelLinear (input_is_parallel=True): dim 1; its bias replicated (NxD adds it after the reduce)
  replicate   left as it is (norms, position embeddings, classifier heads)

NxD is installed only on Neuron hosts; nothing here runs on CPU, where the rules are checked by the SPMD proxy
(`spmd.py`). Not covered: TP above the number of KV heads (NxD's GQAQKVColumnParallelLinear replicates KV
heads and reduces their gradients over the ranks sharing one; converting q/k/v into it is not written yet),
sequence parallelism, and NxD's vocabulary-parallel cross-entropy (the logits are gathered instead).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from neurontrain.errors import UsageError
from neurontrain.parallel.rules import ShardingSpec, rule_for, shard, spec_from_config

_PARTITION = {"vocab": ("vocab", 0), "row": ("row", 1), "o": ("row", 1)}
_PARTITION.update({rule: ("column", 0) for rule in ("column", "q", "k", "v", "gate", "up")})
_BIAS_RULE = {"column": ("column",), "vocab": ("column", "vocab"), "row": ("replicate",)}


@dataclass(frozen=True)
class ParallelLayer:
    """A module to replace: its name, the kind of NxD layer, the weight's partition dim and its sharding rule."""

    module: str
    kind: str  # vocab | column | row
    partition_dim: int
    rule: str


def parallel_layers(spec: ShardingSpec, names: list[str]) -> list[ParallelLayer]:
    """The modules to replace, from the parameter names and the family's rules; a bias must be sharded the way
    NxD's layer shards it (a column layer's with its weight, a row layer's replicated)."""
    rules = {name: rule_for(spec, name) for name in names}
    layers = []
    for name, rule in rules.items():
        if not name.endswith(".weight") or rule == "replicate":
            continue
        module = name.removesuffix(".weight")
        kind, dim = _PARTITION[rule]
        bias_rule = rules.get(f"{module}.bias")
        if bias_rule is not None and bias_rule not in _BIAS_RULE[kind]:
            raise UsageError(f"{module}: a {kind}-parallel layer cannot have a bias sharded by rule {bias_rule!r}")
        layers.append(ParallelLayer(module, kind, dim, rule))
    return layers


def require_nxd(tp: int) -> None:
    """Tensor parallel needs neuronx-distributed (Neuron hosts only): refuse parallel.tp > 1 without it."""
    if tp > 1 and importlib.util.find_spec("neuronx_distributed") is None:
        raise UsageError(
            f"parallel.tp: {tp} needs neuronx-distributed (pip install neuronx-distributed on a Neuron host); "
            "set parallel.tp: 1 here"
        )


def _new_layer(kind: str, old: torch.nn.Module, padded: bool) -> torch.nn.Module:
    from neuronx_distributed.parallel_layers import (  # lazy: installed on Neuron hosts only
        ColumnParallelLinear,
        ParallelEmbedding,
        RowParallelLinear,
    )

    if kind == "vocab" and isinstance(old, torch.nn.Embedding):
        return ParallelEmbedding(old.num_embeddings, old.embedding_dim, padding_idx=old.padding_idx, pad=padded)
    bias = old.bias is not None
    if kind == "row":
        return RowParallelLinear(old.in_features, old.out_features, bias=bias, input_is_parallel=True)
    gather = kind == "vocab"  # the loss reads whole logits
    return ColumnParallelLinear(old.in_features, old.out_features, bias=bias, gather_output=gather, pad=padded)


def model_spec(model: torch.nn.Module, tp: int) -> ShardingSpec:
    """The model's ShardingSpec at TP degree `tp`: what `checkpoint migrate` writes for its weights."""
    names = [name for name, _ in model.named_parameters()]
    return spec_from_config(model.config.to_dict(), names, tp, 1, False, None)


def to_tensor_parallel(model: torch.nn.Module, tp: int) -> torch.nn.Module:
    """Initialise NxD's model parallelism at `tp` and replace the model's layers in place, each rank's weights
    cut from the model's full ones by `rules.shard` (the rank's rows, or columns for row layers)."""
    require_nxd(tp)
    from neuronx_distributed.parallel_layers import parallel_state  # lazy: installed on Neuron hosts only

    spec = model_spec(model, tp)
    if spec.tp > spec.num_kv_heads:
        raise UsageError(f"parallel.tp: {spec.tp} is above the {spec.num_kv_heads} KV heads (not supported yet)")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=spec.tp)
    rank = parallel_state.get_tensor_model_parallel_rank()
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    for layer in parallel_layers(spec, names):
        _replace(model, layer, spec, rank)
    if spec.tied_embeddings:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model


def _replace(model: torch.nn.Module, layer: ParallelLayer, spec: ShardingSpec, rank: int) -> None:
    old = model.get_submodule(layer.module)
    new = _new_layer(layer.kind, old, padded=layer.kind == "vocab" and spec.vocab_padding > 0)
    if getattr(new.weight, "partition_dim", layer.partition_dim) != layer.partition_dim:
        found = new.weight.partition_dim
        raise UsageError(f"{layer.module}: NxD splits this layer on dim {found}, the rules on {layer.partition_dim}")
    with torch.no_grad():
        new.weight.copy_(shard(spec, layer.rule, old.weight, rank))
        if old.bias is not None:
            bias_rule = "replicate" if layer.kind == "row" else "column"
            new.bias.copy_(shard(spec, bias_rule, old.bias, rank))
    parent, _, child = layer.module.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
