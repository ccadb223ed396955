"""Native tensor parallel's pure parts: which families transformers has a plan for (the others refused in one line
naming the family), tied weights kept tied through sharding, how often a gradient's values are counted in the
clipping norm; the memory planner's native TP and FSDP x TP candidates and the mesh `run --dry-run` shows. The
training itself: tests/integration/test_native_tp.py."""

import pytest
import torch
from conftest import RECIPES
from families import tiny_config

from neurontrain.data.sources import prepare_data
from neurontrain.errors import UsageError
from neurontrain.model.build import build_config
from neurontrain.parallel.memory_choice import Pins, native_candidates
from neurontrain.parallel.native_tp import _replicas, _tied_pairs, resolved_plan
from neurontrain.plan.description import describe_plan
from neurontrain.plan.memory_inputs import model_shape
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe


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


BIG = [  # a 0.8B-parameter Llama: DP does not fit 12 GiB a core in fp32, TP 2 does
    "model.config.hidden_size=2048",
    "model.config.intermediate_size=8192",
    "model.config.num_hidden_layers=16",
    "model.config.num_attention_heads=32",
    "model.config.num_key_value_heads=8",
    "train.activation_checkpointing=none",
    "data.batch_size=2",
    "data.train_samples=64",
    "runtime.device_memory_gib=12",
    "data.packing=off",  # rows of one sample each: the activations the figures below were chosen for
]


@pytest.mark.parametrize(
    ("world", "fsdp", "layout", "label"),
    [(2, False, "TP 2", "DP + TP 2"), (4, True, "FSDP 2 x TP 2", "FSDP + TP 2")],
)
def test_the_memory_planner_offers_tp_where_dp_does_not_fit_and_the_plan_shows_the_mesh(world, fsdp, layout, label):
    recipe = load_recipe(RECIPES / "tiny-llama-clm.yaml", [*BIG, f"parallel.fsdp={str(fsdp).lower()}"])
    if fsdp:  # at 4 workers FSDP alone fits 12 GiB: a smaller core makes TP needed
        recipe = load_recipe(
            RECIPES / "tiny-llama-clm.yaml", [*BIG, "parallel.fsdp=true", "runtime.device_memory_gib=4.8"]
        )
    plan = make_plan(recipe, "native", world=world)
    assert plan.memory.choice.config.label() == label and plan.memory.tried[0].config.tp == 1
    assert not plan.memory.tried[0].fits and plan.tp == 2
    assert describe_plan(plan)["mesh"] == {"dp": world // 2, "tp": 2, "fsdp": fsdp, "layout": layout}


def test_native_tp_degrees_split_whole_key_value_heads_and_fsdp_x_tp_needs_replicas_sharded():
    recipe = load_recipe(RECIPES / "tiny-llama-clm.yaml", ["parallel.fsdp=true"])  # 8 heads, 2 KV heads
    shape = model_shape(recipe, build_config(recipe, prepare_data(recipe).tokenizer))
    configs = native_candidates(shape, 4, Pins(fsdp=True), tp_available=True)
    assert [c.label() for c in configs] == [
        "FSDP",
        "FSDP + checkpointing every_4" if shape.layers > 4 else "FSDP + checkpointing full",
        "FSDP + TP 2",
        "FSDP + checkpointing full + TP 2",
    ]
    assert all(c.tp in (1, 2) for c in native_candidates(shape, 4, Pins(fsdp=False), tp_available=True))
    assert not any(c.tp == 2 for c in native_candidates(shape, 4, Pins(fsdp=False), tp_available=True))
