"""ZeRO-1 state conversions (torch-xla's ZeroRedundancyOptimizer format) and resuming across world sizes."""

import pytest
import torch
import torch.nn.functional as F
from conftest import RECIPES

from neurontrain.errors import UsageError
from neurontrain.loop.checkpoints import check_resumable, global_fingerprint
from neurontrain.parallel.zero1_state import chunk, consolidate, rank_state, unchunk
from neurontrain.recipe import load_recipe


def _torch_xla_shard(tensor: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """torch-xla's ZeroRedundancyOptimizer._shard_tensor: pad dim 0 to a multiple of the world, chunk."""
    if tensor.size(0) % world:
        tensor = F.pad(tensor, [0, 0] * (tensor.dim() - 1) + [0, world - tensor.size(0) % world])
    return tensor.chunk(world)[rank]


@pytest.mark.parametrize("rows, world", [(5, 2), (1, 2), (7, 3), (8, 4), (3, 1)])
def test_chunks_are_torch_xla_shards_and_unchunk_undoes_them(rows, world):
    tensor = torch.randn(rows, 3)
    chunks = [chunk(tensor, world, r) for r in range(world)]
    for r, c in enumerate(chunks):
        assert torch.equal(c, _torch_xla_shard(tensor, world, r))
    assert torch.equal(unchunk(chunks, rows), tensor)


def _plain_state(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    state = {
        i: {
            "step": torch.tensor(3.0),
            "exp_avg": torch.randn(s, generator=gen),
            "exp_avg_sq": torch.rand(s, generator=gen),
        }
        for i, s in enumerate(shapes)
    }
    groups = [{"lr": 1e-3, "weight_decay": 0.1, "params": [0, 1]}, {"lr": 1e-3, "weight_decay": 0.0, "params": [2]}]
    return {"state": state, "param_groups": groups}


SHAPES = [(5, 4), (3, 2), (7,)]


def test_rank_states_consolidate_to_the_plain_state_bit_for_bit():
    plain = _plain_state(SHAPES)
    masters = [torch.randn(s) for s in SHAPES]
    ranks = [rank_state(plain, SHAPES, masters, 2, r) for r in range(2)]
    assert ranks[1]["dp_rank"] == 1 and ranks[1]["state"] == {}
    assert ranks[1]["base_state"][0]["exp_avg"].shape == (3, 4)  # 5 rows padded to 6, 3 each
    assert not ranks[1]["base_state"][0]["exp_avg"][2:].any()
    back, back_masters = consolidate(ranks)
    assert back["param_groups"] == plain["param_groups"]
    for i in plain["state"]:
        for key, value in plain["state"][i].items():
            assert torch.equal(back["state"][i][key], value), (i, key)
    assert all(torch.equal(a, b) for a, b in zip(back_masters, masters))


def test_two_ranks_resplit_for_three_and_one_keep_the_state():
    plain = _plain_state(SHAPES, seed=1)
    masters = [torch.randn(s) for s in SHAPES]
    two = [rank_state(plain, SHAPES, masters, 2, r) for r in range(2)]
    mid, mid_masters = consolidate(two)
    three = [rank_state(mid, SHAPES, mid_masters, 3, r) for r in range(3)]
    assert three[2]["sharded_master_weights"][1].shape == (1, 2)
    final, final_masters = consolidate(three)
    one, _ = consolidate([rank_state(final, SHAPES, final_masters, 1, 0)])
    for i in plain["state"]:
        assert torch.equal(one["state"][i]["exp_avg_sq"], plain["state"][i]["exp_avg_sq"])
    assert all(torch.equal(a, b) for a, b in zip(final_masters, masters))


def test_consolidate_refuses_rank_states_of_another_world():
    plain = _plain_state(SHAPES)
    masters = [torch.zeros(s) for s in SHAPES]
    mixed = [rank_state(plain, SHAPES, masters, 2, 0), rank_state(plain, SHAPES, masters, 3, 1)]
    with pytest.raises(ValueError, match="chunk has shape"):
        consolidate(mixed)
    with pytest.raises(ValueError, match="same world"):
        consolidate([rank_state(plain, SHAPES, masters, 2, 1), rank_state(plain, SHAPES, masters, 2, 0)])


def _recipe(*overrides):
    return load_recipe(RECIPES / "tiny-llama-clm.yaml", list(overrides))


def test_a_checkpoint_resumes_at_another_world_size_only_with_the_same_global_batches():
    two = _recipe("data.batch_size=8")
    meta = {"fingerprint": two.fingerprint(), "world_size": 2, "global_fingerprint": global_fingerprint(two, 2)}
    check_resumable("ckpt", meta, two, 2)
    check_resumable("ckpt", meta, _recipe("data.batch_size=16"), 1)  # 16 rows a batch, as 8 x 2
    with pytest.raises(UsageError, match="written by 2 workers, this run has 1"):
        check_resumable("ckpt", meta, two, 1)
    with pytest.raises(UsageError, match="different recipe"):
        check_resumable("ckpt", meta, _recipe("data.batch_size=16", "train.optimizer.lr=0.1"), 1)
