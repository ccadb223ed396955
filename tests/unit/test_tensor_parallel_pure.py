"""Pure parts of tensor-parallel training: one rank's tensors fused into NxD's names and split back (what a TP
run writes and reads), the limits refused before any worker starts, and per-rank checkpoint files."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_parallel_layouts import LLAMA_NAMES

from neurontrain.checkpoint.formats import SafetensorsSource
from neurontrain.checkpoint.nxd import rank_tensors
from neurontrain.errors import UsageError
from neurontrain.loop.checkpoints import save_checkpoint
from neurontrain.parallel.nxd_layout import fuse_moments, fuse_rank, unfuse_moments, unfuse_rank
from neurontrain.parallel.rules import ShardingSpec, rule_for, shard
from neurontrain.parallel.tensor_parallel import check_trainable
from neurontrain.plan.layouts import pinned_tp
from neurontrain.recipe import load_recipe

NAMES = LLAMA_NAMES  # embeddings, one layer (q, k, v, o, gate, up, down, a norm), the final norm, lm_head
SHAPES = [(64, 32), (64, 32), (16, 32), (16, 32), (32, 64), (48, 32), (48, 32), (32, 48), (32,), (32,), (64, 32)]


def _spec(tp: int, kv: int = 2, vocab: int = 64, fuse_qkv: bool = False) -> ShardingSpec:
    return ShardingSpec("llama", tp, 1, 1, 8, kv, 8, vocab, fuse_qkv=fuse_qkv, names=NAMES)


@pytest.mark.parametrize("fuse_qkv", [False, True])
def test_a_ranks_pieces_fuse_like_migrate_and_split_back(fuse_qkv: bool, tmp_path: Path):
    torch.manual_seed(0)
    spec = _spec(2, fuse_qkv=fuse_qkv)
    full = {name: torch.randn(shape) for name, shape in zip(NAMES, SHAPES)}
    save_file(full, str(tmp_path / "model.safetensors"))
    source = SafetensorsSource([tmp_path / "model.safetensors"], None, "test", "safetensors", "save_file")
    for rank in range(2):
        pieces = {name: shard(spec, rule_for(spec, name), full[name], rank) for name in NAMES}
        fused = fuse_rank(spec, NAMES, lambda name, rule, pieces=pieces: pieces[name])
        migrated = rank_tensors(spec, source, NAMES, rank, lambda t: t)
        assert fused.keys() == migrated.keys() and all(torch.equal(fused[k], migrated[k]) for k in fused)
        back = unfuse_rank(spec, NAMES, fused)
        assert back.keys() == pieces.keys() and all(torch.equal(back[n], pieces[n]) for n in NAMES)
    assert "model.layers.0.mlp.gate_up_proj.weight" in fused and "model.layers.0.mlp.up_proj.weight" not in fused


def test_adamw_state_fuses_and_splits_back():
    spec = _spec(2)
    state = {
        n: {"exp_avg": torch.randn(s), "exp_avg_sq": torch.rand(s), "step": torch.tensor(3.0)}
        for n, s in zip(NAMES, SHAPES)
    }
    fused = fuse_moments(spec, NAMES, lambda name, rule, kind: state[name][kind], lambda name: state[name]["step"])
    assert set(fused["model.layers.0.mlp.gate_up_proj.weight"]) == {"exp_avg", "exp_avg_sq", "step"}
    back = unfuse_moments(spec, NAMES, fused)
    for name in NAMES:
        assert all(torch.equal(back[name][k], state[name][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    # AdamW adds to a tensor step in place: the members of a fused group must not share one
    steps = [back[f"model.layers.0.mlp.{p}_proj.weight"]["step"] for p in ("gate", "up")]
    steps[0] += 1
    assert steps[1] == 3.0


def test_tp_above_the_kv_heads_is_refused_in_one_line():
    with pytest.raises(
        UsageError, match=r"parallel.tp: 4 is above the model's 2 KV heads .*GQAQKVColumnParallelLinear"
    ):
        check_trainable(_spec(4))
    check_trainable(_spec(2))


def test_a_vocabulary_tp_does_not_divide_is_refused():
    spec = ShardingSpec("llama", 2, 1, 1, 8, 2, 8, 63, names=NAMES, padded_vocab_size=64)
    with pytest.raises(UsageError, match="does not divide the vocabulary"):
        check_trainable(spec)


def test_tp_must_divide_the_workers(recipes):
    recipe = load_recipe(recipes / "tiny-llama-clm.yaml", ["parallel.tp=2"])
    assert pinned_tp(recipe, 4) == 2
    with pytest.raises(UsageError, match=r"parallel.tp: 2 needs a multiple of 2 workers \(this run has 3\)"):
        pinned_tp(recipe, 3)
    assert pinned_tp(load_recipe(recipes / "tiny-llama-clm.yaml"), 3) == 1  # auto: the planner decides


def test_rank_files_land_in_the_checkpoint(tmp_path):
    files = {"model/dp_rank_00_tp_rank_01_pp_rank_00.pt": {"w": torch.ones(2)}, "checkpoint_spec.json": {"tp": 2}}
    final = save_checkpoint(tmp_path, 3, {"s": 1}, {"step": 3}, 2, torch.save, rank_file=files)
    assert torch.load(final / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt")["w"].equal(torch.ones(2))
    assert json.loads((final / "checkpoint_spec.json").read_text()) == {"tp": 2}
