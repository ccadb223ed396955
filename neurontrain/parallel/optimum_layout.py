"""optimum-neuron's tensor-parallel models, as data derived from the sharding rules (rules.py): the parameter
names its models have at a TP size, and the `mp_metadata_pp_rank_<p>.json` its `save_pretrained` writes beside
the shards, which its consolidation (`optimum-cli neuron consolidate`) reads. Pure functions; the facts and their
sources are in docs/neuron-contracts.md.

Attention (optimum-neuron 0.4.5 `models/training/llama/modeling_llama.py`, as NxD's example Llama):
  KV heads < TP, or TP not dividing them   GQAQKVColumnParallelLinear `qkv_proj.weight_q/_k/_v` (`weight_qkv`
                                           fused), KV heads repeated `kv_size_multiplier = TP // KV` times;
                                           metadata: a GQAQKVColumnParallelLinearSpec on the attention module
  else, fused q/k/v and as many KV heads   one ColumnParallelLinear `qkv_proj.weight` (stride 3): a
  as query heads                           FusedLinearsSpec of q_proj, k_proj, v_proj
  else                                     separate q_proj / k_proj / v_proj, ColumnParallelLinear
gate and up are one `gate_up_proj` (stride 2): a FusedLinearsSpec of gate_proj, up_proj. Every parameter is listed
with NxD's tensor-parallel attributes (`partition_dim`, stride, partitions) or as not parallel; consolidation
concatenates the listed parallel ones on their partition_dim and keeps rank 0's copy of the others, and drops
what the metadata does not list.
"""

from __future__ import annotations

from neurontrain.errors import UsageError
from neurontrain.parallel.nxd_layout import fused_groups
from neurontrain.parallel.rules import PACKED, ShardingSpec, neuron_name, split_dim

GQA_SPEC, FUSED_SPEC = "GQAQKVColumnParallelLinearSpec", "FusedLinearsSpec"
METADATA_FILE = "mp_metadata_pp_rank_{}.json"
TRN_CONFIG_FILE = "trn_config.json"
# the model types optimum-neuron 0.4.5 has training models for (models/training/auto_models.py)
TRAINING_FAMILIES = ("llama", "granite", "qwen3")


def trn_config(spec: ShardingSpec, use_xser: bool) -> dict:
    """trn_config.json as optimum-neuron 0.4.5's save_pretrained writes it (`asdict(self.trn_config)`, the
    TrainingNeuronConfig fields in their order): its defaults, with this layout's parallel sizes, fused q/k/v and
    serialization. sequence_parallel_enabled and the rest are training choices the shards do not fix."""
    return {
        "tensor_parallel_size": spec.tp,
        "sequence_parallel_enabled": False,
        "kv_size_multiplier": None,  # its attention derives TP // KV heads, the multiplier the shards were cut with
        "pipeline_parallel_size": spec.pp,
        "virtual_pipeline_parallel_size": 1,
        "pipeline_parallel_num_microbatches": 1,
        "pipeline_parallel_use_zero1_optimizer": False,
        "gradient_checkpointing": False,
        "checkpoint_dir": None,
        "num_local_ranks_per_step": 8,
        "use_xser": use_xser,
        "async_save": False,
        "fuse_qkv": spec.fuse_qkv,
        "recompute_causal_mask": True,
        "transpose_nki_inputs": True,
    }


def training_note(family: str) -> str | None:
    """What a user of `--layout optimum-neuron` for a family optimum-neuron cannot train must know, or None."""
    if family in TRAINING_FAMILIES:
        return None
    return (
        f"--layout optimum-neuron: optimum-neuron 0.4.5 has no training model for {family} (only "
        f"{', '.join(TRAINING_FAMILIES)}): its consolidation and NxD's load_checkpoint read these shards, no "
        "optimum-neuron trainer trains from them"
    )


def gqa_linear(spec: ShardingSpec) -> bool:
    """Whether the attention is NxD's GQAQKVColumnParallelLinear at this TP (optimum-neuron's `qkv_linear`)."""
    return spec.num_kv_heads < spec.tp or spec.num_kv_heads % spec.tp != 0


def _mha_fused(spec: ShardingSpec) -> bool:
    return spec.fuse_qkv and not gqa_linear(spec) and spec.num_heads == spec.num_kv_heads


def optimum_name(spec: ShardingSpec, name: str, rule: str) -> str:
    """The parameter's name in optimum-neuron's model at the spec's TP size."""
    if rule in ("q", "k", "v") and not gqa_linear(spec):
        if not _mha_fused(spec):
            return name
        prefix, _, leaf = name.rsplit(".", 2)
        return f"{prefix}.qkv_proj.{leaf}"
    return neuron_name(spec, name, rule)


def check_expressible(spec: ShardingSpec, rules: dict[str, str]) -> None:
    """A UsageError unless optimum-neuron's model and consolidation hold these tensors as the rules shard them.
    `rules`: hf name -> rule."""
    packed = next((n for n, r in rules.items() if r in PACKED), None)
    if packed:
        raise UsageError(
            f"--layout optimum-neuron: {packed} is a packed tensor (rule {rules[packed]!r}); optimum-neuron's "
            "consolidation has no transformation that rebuilds a packed tensor from per-rank pieces"
        )
    if spec.vocab_padding:
        raise UsageError(
            f"--layout optimum-neuron: --tp {spec.tp} leaves {spec.vocab_size} vocabulary rows unevenly split, and "
            "optimum-neuron's consolidation keeps padding rows: choose a TP that divides the vocabulary"
        )
    if spec.fuse_qkv and not gqa_linear(spec) and spec.num_heads != spec.num_kv_heads:
        raise UsageError(
            f"--layout optimum-neuron: at --tp {spec.tp} (<= {spec.num_kv_heads} KV heads, fewer than the "
            f"{spec.num_heads} query heads) optimum-neuron's attention keeps q_proj/k_proj/v_proj: drop --fuse-qkv"
        )
    biased = next((n for n, r in rules.items() if r in ("q", "k", "v") and n.endswith(".bias")), None)
    if biased and gqa_linear(spec):
        raise UsageError(
            f"--layout optimum-neuron: {biased} is a bias of attention held by GQAQKVColumnParallelLinear at --tp "
            f"{spec.tp}; optimum-neuron's spec for it rebuilds q, k, v and o biases together, as tensor-parallel "
            "ones, and o_proj's bias is not: use a --tp that divides the KV heads"
        )


def _attributes(spec: ShardingSpec, target: str, members: list[tuple[str, str]], ndim: int) -> dict:
    rule = members[0][1]
    if rule == "replicate" or target.endswith("_qkv"):
        # NxD's GQAQKVColumnParallelLinear sets no tensor-parallel attributes on its fused weight_qkv
        return {"tensor_model_parallel": False}
    return {
        "tensor_model_parallel": True,
        "partition_dim": split_dim(rule, ndim),
        "partition_stride": len(members),
        "num_partitions": spec.tp,
    }


def _spec_entry(cls_name: str, fields: dict) -> list:
    return [cls_name, {**fields, "peft_type": None}]


def _gqa_fields(spec: ShardingSpec, q_rows: int) -> dict:
    return {
        "gqa_qkv_projection_name": "qkv_proj",
        "query_projection_name": "q_proj",
        "key_projection_name": "k_proj",
        "value_projection_name": "v_proj",
        "output_projection_name": "o_proj",
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "kv_size_multiplier": spec.kv_multiplier,
        "q_output_size_per_partition": q_rows // spec.tp,
        "kv_output_size_per_partition": spec.head_dim * spec.num_kv_heads * spec.kv_multiplier // spec.tp,
        "fuse_qkv": spec.fuse_qkv,
        "bias": False,  # check_expressible refuses biased attention here
        "tp_size": spec.tp,
    }


def _fused_fields(spec: ShardingSpec, target: str, members: list, shapes: dict) -> dict:
    module = members[0][0].rsplit(".", 2)[0]
    return {
        "fused_linear_name": target.rsplit(".", 2)[1],
        "linear_names": [n.rsplit(".", 2)[1] for n, _ in members],
        "bias": any(f"{module}.{n.rsplit('.', 2)[1]}.bias" in shapes for n, _ in members),
        "fuse_axis": 0,
        "original_dims": [shapes[n][0] for n, _ in members],
        "tp_size": spec.tp,
    }


def _module_specs(spec: ShardingSpec, groups: dict, shapes: dict[str, tuple[int, ...]]) -> dict[str, list]:
    """module -> its serialized transformation specs (ModelWeightTransformationSpecs.to_metadata's form), in the
    order of the modules' parameters."""
    modules: dict[str, list] = {}
    for target, members in groups.items():
        first_name, first_rule = members[0]
        module = first_name.rsplit(".", 2)[0]
        if first_rule in ("q", "k", "v") and gqa_linear(spec):
            if module not in modules:
                fields = _gqa_fields(spec, shapes[f"{module}.q_proj.weight"][0])
                modules[module] = [_spec_entry(GQA_SPEC, fields)]
        elif len(members) > 1 and target.endswith(".weight"):
            modules.setdefault(module, []).append(_spec_entry(FUSED_SPEC, _fused_fields(spec, target, members, shapes)))
    return modules


def stage_metadata(spec: ShardingSpec, names: list[str], shapes: dict[str, tuple[int, ...]]) -> dict:
    """optimum-neuron's `mp_metadata_pp_rank_<p>.json` of one pipeline stage holding `names` (hf names), as its
    `create_parameter_metadata` writes it; `shapes`: the hf tensors' shapes."""
    groups = fused_groups(spec, names, optimum_name)
    parameters = {
        target: _attributes(spec, target, members, len(shapes[members[0][0]])) for target, members in groups.items()
    }
    specs = _module_specs(spec, groups, shapes)
    return {
        "parameters": parameters,
        "model_weight_transformation_specs": [
            {"module_fully_qualified_name": module, "specs": entries} for module, entries in specs.items()
        ],
    }
