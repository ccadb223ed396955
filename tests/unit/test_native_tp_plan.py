"""Native tensor parallel's pure parts: which families transformers has a plan for (the others refused in one line
naming the family), tied weights kept tied through sharding, and how often a gradient's values are counted in the
clipping norm. The training itself: tests/integration/test_native_tp.py."""

import pytest
import torch
from families import tiny_config

from neurontrain.errors import UsageError
from neurontrain.parallel.native_tp import _replicas, _tied_pairs, resolved_plan


def _meta(model_type: str, **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral"])
def test_a_family_with_a_plan_shards_attention_and_mlp_by_it(model_type):
    plan = resolved_plan(_meta(model_type), 2)
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise" and plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert plan["model.embed_tokens"] == "embedding_rowwise"


def test_a_family_without_a_plan_is_refused_in_one_line_naming_it():
    with pytest.raises(UsageError, match=r"transformers has no tensor-parallel plan for gpt2 \(") as caught:
        resolved_plan(_meta("gpt2"), 2)
    assert "\n" not in str(caught.value)


def test_tp_above_the_key_value_heads_is_refused():
    with pytest.raises(UsageError, match="does not divide llama's 4 attention heads and 2 key/value heads"):
        resolved_plan(_meta("llama"), 4)


def test_tied_weights_are_found_to_be_tied_again_after_sharding():
    model = _meta("qwen3", tie_word_embeddings=True)
    [((owner, name), (source, source_name))] = _tied_pairs(model)
    assert getattr(owner, name) is getattr(source, source_name) is model.model.embed_tokens.weight


class _Mesh:
    def __init__(self, *sizes: int) -> None:
        self.sizes = sizes

    def size(self, dim: int) -> int:
        return self.sizes[dim]


class _DTensorLike:
    def __init__(self, mesh: _Mesh, *placements) -> None:
        self.device_mesh, self.placements = mesh, placements


def test_each_slice_of_a_gradient_counts_once_in_the_norm():
    from torch.distributed.tensor import Replicate, Shard

    assert _replicas(torch.zeros(3), 4) == 4  # a plain tensor: the same on every worker
    assert _replicas(_DTensorLike(_Mesh(2), Shard(0)), 2) == 1  # TP alone: each worker its own slice
    assert _replicas(_DTensorLike(_Mesh(2), Shard(0)), 4) == 2  # FSDP2's slice, the same on both TP ranks
    assert _replicas(_DTensorLike(_Mesh(2, 2), Shard(0), Shard(0)), 4) == 1  # FSDP2 x TP
    assert _replicas(_DTensorLike(_Mesh(2, 2), Shard(0), Replicate()), 4) == 2
