"""Tensor parallel on Neuron through neuronx-distributed (NxD): a Hugging Face Llama or BERT model's linear and
embedding layers replaced by NxD's parallel layers, chosen by the same rules `checkpoint migrate` shards by
(`rules.py`), and each rank's weights cut by the same `shard` function.

Which layer a module becomes follows from the rule of its weight:
  vocab       ParallelEmbedding (an embedding) or ColumnParallelLinear with gathered output (lm_head): dim 0
  column, q, k, v, gate, up    ColumnParallelLinear (gather_output=False): dim 0; its bias split with it
  row, o      RowParallelLinear (input_is_parallel=True): dim 1; its bias replicated (NxD adds it after the reduce)
  replicate   left as it is (norms, position embeddings, classifier heads)

Written to NxD 2.29's source (parallel_layers/layers.py, parallel_state.py); NxD is installed only on Neuron
hosts. On CPU the tests run this code against a stand-in with NxD's interface and real arithmetic over gloo
(tests/standin/nxd), and the rules themselves through the SPMD proxy (`spmd.py`). Not covered (refused with a
one-line error where it matters): TP above the number of KV heads (NxD's GQAQKVColumnParallelLinear
replicates KV heads and reduces their gradients over the ranks sharing one; converting q/k/v into it is not
written yet), a vocabulary TP does not divide (NxD pads vocabulary-parallel layers for inference only),
sequence parallelism, and NxD's vocabulary-parallel cross-entropy (the logits are gathered instead).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from neurontrain.errors import UsageError
from neurontrain.parallel.plans import training_refusal
from neurontrain.parallel.rules import ShardingSpec, rule_for, shard, spec_from_config

_PARTITION = {"vocab": ("vocab", 0), "row": ("row", 1), "o": ("row", 1)}
_PARTITION.update({rule: ("column", 0) for rule in ("column", "q", "k", "v", "gate", "up")})
NXD_RULES = (*_PARTITION, "replicate")  # the rules NxD's layers here take
_BIAS_RULE = {"column": ("column", "q", "k", "v", "gate", "up"), "vocab": ("replicate",), "row": ("replicate",)}


@dataclass(frozen=True)
class ParallelLayer:
    """A module to replace: its name, the kind of NxD layer, the weight's partition dim and its sharding rule."""

    module: str
    kind: str  # vocab | column | row
    partition_dim: int
    rule: str


def parallel_layers(spec: ShardingSpec, names: list[str]) -> list[ParallelLayer]:
    """The modules to replace, from the parameter names and the family's rules; a bias must be sharded the way
    NxD's layer shards it (a column layer's with its weight; a row layer's, and that of a column layer that
    gathers its output, replicated)."""
    rules = {name: rule_for(spec, name) for name in names}
    layers = []
    for name, rule in rules.items():
        if rule == "replicate" or name.endswith(".bias"):
            continue
        if rule not in _PARTITION or not name.endswith(".weight"):
            raise UsageError(f"parallel.tp: {name} is sharded by rule {rule!r}, which NxD's layers here do not take")
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


def _new_layer(kind: str, old: torch.nn.Module) -> torch.nn.Module:
    from neuronx_distributed.parallel_layers import (  # lazy: installed on Neuron hosts only
        ColumnParallelLinear,
        ParallelEmbedding,
        RowParallelLinear,
    )

    if kind == "vocab" and isinstance(old, torch.nn.Embedding):
        return ParallelEmbedding(old.num_embeddings, old.embedding_dim, padding_idx=old.padding_idx)
    bias = old.bias is not None
    if kind == "row":
        return RowParallelLinear(old.in_features, old.out_features, bias=bias, input_is_parallel=True)
    gather = kind == "vocab"  # the loss reads whole logits
    return ColumnParallelLinear(old.in_features, old.out_features, bias=bias, gather_output=gather)


def model_spec(model: torch.nn.Module, tp: int) -> ShardingSpec:
    """The model's ShardingSpec at TP degree `tp`: what `checkpoint migrate` writes for its weights."""
    names = [name for name, _ in model.named_parameters()]
    return spec_from_config(model.config.to_dict(), names, tp, 1, False, None)


def check_trainable(spec: ShardingSpec) -> None:
    """The limits of tensor-parallel training here, each a one-line UsageError."""
    refusal = training_refusal(spec.family)
    if refusal:
        raise UsageError(f"parallel.tp: {spec.tp}: {refusal}")
    if spec.tp > spec.num_kv_heads:
        raise UsageError(
            f"parallel.tp: {spec.tp} is above the model's {spec.num_kv_heads} KV heads (NxD's "
            "GQAQKVColumnParallelLinear, which replicates KV heads, is not wired yet)"
        )
    if spec.vocab_padding:
        raise UsageError(
            f"parallel.tp: {spec.tp} does not divide the vocabulary ({spec.vocab_size}); NxD pads vocabulary-parallel "
            "layers for inference only: pad model.config.vocab_size to a multiple of the TP degree"
        )


def to_tensor_parallel(model: torch.nn.Module, tp: int) -> torch.nn.Module:
    """Replace the model's layers in place by NxD's parallel layers at degree `tp` (NxD's model parallel state
    must be initialised), each rank's weights cut from the model's full ones by `rules.shard` (the rank's rows,
    or columns for row layers). The CPU random state is left as it was (NxD's layers draw their own initial
    weights from it, which are then replaced)."""
    require_nxd(tp)
    from neuronx_distributed.parallel_layers import parallel_state  # lazy: installed on Neuron hosts only

    spec = model_spec(model, tp)
    check_trainable(spec)
    if not parallel_state.model_parallel_is_initialized():
        raise UsageError("tensor parallel: NxD's model parallel state is not initialised (start the workers first)")
    if parallel_state.get_tensor_model_parallel_size() != tp:
        found = parallel_state.get_tensor_model_parallel_size()
        raise UsageError(f"parallel.tp: {tp}, but NxD's model parallel state was initialised for {found}")
    rank = parallel_state.get_tensor_model_parallel_rank()
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    with torch.random.fork_rng(devices=[]):
        for layer in parallel_layers(spec, names):
            _replace(model, layer, spec, rank)
    if spec.tied_embeddings and model.get_output_embeddings() is not None:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model


def _replace(model: torch.nn.Module, layer: ParallelLayer, spec: ShardingSpec, rank: int) -> None:
    old = model.get_submodule(layer.module)
    new = _new_layer(layer.kind, old)
    if getattr(new.weight, "partition_dim", layer.partition_dim) != layer.partition_dim:
        found = new.weight.partition_dim
        raise UsageError(f"{layer.module}: NxD splits this layer on dim {found}, the rules on {layer.partition_dim}")
    with torch.no_grad():
        new.weight.copy_(shard(spec, layer.rule, old.weight, rank))
        if getattr(old, "bias", None) is not None:
            # NxD keeps a row layer's bias whole, and a column layer's too when it gathers its output
            bias_rule = layer.rule if layer.kind == "column" else "replicate"
            new.bias.copy_(shard(spec, bias_rule, old.bias, rank))
    parent, _, child = layer.module.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
