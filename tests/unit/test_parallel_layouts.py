"""Pure parts of activation checkpointing, tensor parallel (NxD layers) and the SPMD proxy, derived from the
sharding rules: which layers are checkpointed, which NxD layer each module becomes, which partition spec each
tensor gets; and that each SPMD layout cuts the same pieces as `rules.shard`."""

import pytest
import torch

from neurontrain.errors import UsageError
from neurontrain.parallel.checkpointing import checkpoint_interval, checkpointed_layers
from neurontrain.parallel.rules import ShardingSpec, rule_for, shard
from neurontrain.parallel.spmd import mesh_shape, partition_spec
from neurontrain.parallel.tensor_parallel import parallel_layers, require_nxd

LLAMA_NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
]
BERT_NAMES = [
    "bert.embeddings.word_embeddings.weight",
    "bert.embeddings.position_embeddings.weight",
    "bert.encoder.layer.0.attention.self.query.weight",
    "bert.encoder.layer.0.attention.self.query.bias",
    "bert.encoder.layer.0.attention.output.dense.weight",
    "bert.encoder.layer.0.attention.output.dense.bias",
    "bert.encoder.layer.0.intermediate.dense.weight",
    "bert.encoder.layer.0.output.dense.weight",
    "bert.encoder.layer.0.output.LayerNorm.weight",
    "classifier.weight",
]


def _spec(family: str, tp: int, heads: int = 8, kv: int = 2, vocab: int = 256) -> ShardingSpec:
    return ShardingSpec(family, tp, 1, 2, heads, kv, 8, vocab)


@pytest.mark.parametrize(
    ("setting", "layers", "expected"),
    [("none", 4, []), ("auto", 4, []), ("full", 3, [0, 1, 2]), ("every_2", 5, [0, 2, 4]), ("every_4", 3, [0])],
)
def test_checkpointed_layers(setting: str, layers: int, expected: list[int]):
    assert checkpointed_layers(setting, layers) == expected


def test_bad_checkpointing_setting_is_usage_error():
    with pytest.raises(UsageError, match="every_N"):
        checkpoint_interval("every_0")


def test_nxd_layers_follow_the_rules():
    llama = {
        layer.module: (layer.kind, layer.partition_dim) for layer in parallel_layers(_spec("llama", 2), LLAMA_NAMES)
    }
    assert llama == {
        "model.embed_tokens": ("vocab", 0),
        "model.layers.0.self_attn.q_proj": ("column", 0),
        "model.layers.0.self_attn.k_proj": ("column", 0),
        "model.layers.0.self_attn.v_proj": ("column", 0),
        "model.layers.0.self_attn.o_proj": ("row", 1),
        "model.layers.0.mlp.gate_proj": ("column", 0),
        "model.layers.0.mlp.up_proj": ("column", 0),
        "model.layers.0.mlp.down_proj": ("row", 1),
        "lm_head": ("vocab", 0),
    }
    bert = {layer.module: layer.kind for layer in parallel_layers(_spec("bert", 2, 4, 4, 512), BERT_NAMES)}
    assert bert == {
        "bert.embeddings.word_embeddings": "vocab",
        "bert.encoder.layer.0.attention.self.query": "column",
        "bert.encoder.layer.0.attention.output.dense": "row",
        "bert.encoder.layer.0.intermediate.dense": "column",
        "bert.encoder.layer.0.output.dense": "row",
    }


def test_nxd_layer_refuses_a_bias_sharded_against_its_weight(monkeypatch):
    from neurontrain.parallel import rules

    wrong = [(r"attention\.output\.dense\.bias$", "column"), *rules.BERT_RULES]
    monkeypatch.setitem(rules.FAMILIES, "bert", wrong)
    with pytest.raises(UsageError, match="row-parallel layer cannot have a bias sharded by rule 'column'"):
        parallel_layers(_spec("bert", 2, 4, 4, 512), BERT_NAMES)


def test_tp_without_nxd_is_usage_error():
    require_nxd(1)  # nothing to refuse
    with pytest.raises(UsageError, match="parallel.tp: 2 needs neuronx-distributed"):
        require_nxd(2)


def _spmd_pieces(spec: ShardingSpec, rule: str, full: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's piece under the SPMD partition spec, cut as XLA's tiling does: the mesh (copy, kv) holds
    device r at (r // kv, r % kv); a dim split over axes (a, b) has a-major tiles."""
    partition = partition_spec(spec, rule, full.dim())
    if all(axes is None for axes in partition):
        return [full] * spec.tp
    copy, kv = mesh_shape(spec)
    dim = next(i for i, axes in enumerate(partition) if axes is not None)
    axes = partition[dim] if isinstance(partition[dim], tuple) else (partition[dim],)
    sizes = {"copy": copy, "kv": kv}
    pieces = []
    for rank in range(spec.tp):
        coord = {"copy": rank // kv, "kv": rank % kv}
        tile, count = 0, 1
        for axis in axes:
            tile, count = tile * sizes[axis] + coord[axis], count * sizes[axis]
        pieces.append(full.chunk(count, dim=dim)[tile])
    return pieces


@pytest.mark.parametrize(("tp", "kv"), [(2, 2), (4, 2), (8, 2), (2, 4), (4, 4), (1, 2)])
def test_spmd_layout_cuts_the_pieces_of_rules_shard(tp: int, kv: int):
    spec = _spec("llama", tp, heads=8, kv=kv)
    shapes = {"q": (64, 64), "k": (8 * kv, 64), "v": (8 * kv, 64), "o": (64, 64), "vocab": (256, 64)}
    shapes.update({"gate": (128, 64), "up": (128, 64), "row": (64, 128), "replicate": (64,)})
    for name in LLAMA_NAMES:
        rule = rule_for(spec, name)
        full = torch.arange(torch.Size(shapes[rule]).numel(), dtype=torch.float32).reshape(shapes[rule])
        for rank, piece in enumerate(_spmd_pieces(spec, rule, full)):
            assert torch.equal(piece, shard(spec, rule, full, rank)), (name, rank)


def test_spmd_proxy_refuses_vocabulary_padding():
    spec = ShardingSpec("llama", 4, 1, 2, 8, 2, 8, 250, padded_vocab_size=252)
    with pytest.raises(UsageError, match="divide the vocabulary"):
        partition_spec(spec, "vocab", 2)
