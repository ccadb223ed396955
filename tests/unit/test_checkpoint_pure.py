import math
from pathlib import Path

import pytest
import torch

from neurontrain.checkpoint import verify
from neurontrain.errors import UsageError
from neurontrain.loop import checkpoints as ckpt
from neurontrain.loop.optim import lr_factor
from neurontrain.parallel.rules import ShardingSpec, merge, shard, vocab_size_with_padding


def test_steps_to_prune_keeps_newest():
    assert ckpt.steps_to_prune([10, 30, 20, 40], 2) == [10, 20]
    assert ckpt.steps_to_prune([10], 3) == []


def test_atomic_save_publish_and_prune(tmp_path: Path):
    for step in (10, 20, 30):
        ckpt.save_checkpoint(tmp_path, step, {"x": torch.tensor([step])}, {"step": step}, keep=2, save_fn=torch.save)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [20, 30]
    state, meta = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))
    assert state["x"].item() == 30 and meta["step"] == 30


def test_partial_writes_are_ignored_and_cleaned(tmp_path: Path):
    ckpt.save_checkpoint(tmp_path, 10, {"x": 1}, {"step": 10}, keep=3, save_fn=torch.save)
    (tmp_path / ".step_00000020.partial").mkdir()
    (tmp_path / ".step_00000020.partial" / "state.pt").write_bytes(b"trunc")
    (tmp_path / "step_00000030").mkdir()  # no marker
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000010"
    removed = ckpt.remove_partial(tmp_path)
    assert sorted(removed) == [".step_00000020.partial", "step_00000030"]


def test_lr_never_exactly_zero_or_jumps():
    for kind in ("linear", "cosine", "constant"):
        factors = [lr_factor(s, 50, kind, 5, 0.0) for s in range(50)]
        assert all(f > 0 for f in factors)
        assert factors[0] < factors[4] <= 1.0


# -- vocabulary padding (pure: torch only, no torch-xla) -----------------------------------------------------


@pytest.mark.parametrize(
    "vocab, tp, multiple, expected",
    [
        (21, 4, None, 24),
        (50, 4, None, 52),
        (128, 4, None, 128),
        (32001, 8, None, 32008),
        (50257, 8, None, 50264),
        (50257, 1, None, 50257),
        (50257, 8, 128, 50304),
        (21, 4, 6, 24),
        (21, 4, 8, 24),
        (24, 4, 8, 24),
        (25, 4, 8, 32),
        (0, 4, None, 0),
    ],
)
def test_vocab_size_with_padding(vocab, tp, multiple, expected):
    assert vocab_size_with_padding(vocab, tp, multiple) == expected


def test_vocab_size_with_padding_rejects_nonpositive_factors():
    with pytest.raises(ValueError):
        vocab_size_with_padding(21, 0)
    with pytest.raises(ValueError):
        vocab_size_with_padding(21, 4, 0)


def _spec(vocab: int, tp: int, padded: int | None) -> ShardingSpec:
    return ShardingSpec("llama", tp, 1, 2, 8, 2, 8, vocab, padded_vocab_size=padded)


@pytest.mark.parametrize("vocab, tp, padded", [(21, 4, 24), (21, 4, 64), (50, 4, 52), (7, 8, 8), (21, 1, 32)])
def test_padded_vocab_shards_are_zero_padded_and_merge_strips_them(vocab, tp, padded):
    spec = _spec(vocab, tp, padded)
    spec.validate()
    full = torch.arange(vocab * 3, dtype=torch.float32).reshape(vocab, 3) + 1  # no zero among the real rows
    pieces = [shard(spec, "vocab", full, r) for r in range(tp)]
    assert all(p.shape == (padded // tp, 3) for p in pieces)
    stacked = torch.cat(pieces)
    assert torch.equal(stacked[:vocab], full) and not stacked[vocab:].any()
    assert torch.equal(merge(spec, "vocab", pieces), full)
    stacked[vocab:] = 5.0  # training writes into the padding too: merge drops it whatever it holds
    assert torch.equal(merge(spec, "vocab", list(stacked.chunk(tp))), full)


def test_unpadded_vocab_is_split_as_before():
    spec = _spec(128, 4, 128)
    full = torch.randn(128, 4)
    assert [tuple(shard(spec, "vocab", full, r).shape) for r in range(4)] == [(32, 4)] * 4
    assert spec.vocab_padding == 0 and _spec(128, 4, None).vocab_rows == 128  # specs written before padding


def test_padding_checks():
    with pytest.raises(UsageError, match="vocabulary size 21 is not divisible by --tp 4"):
        _spec(21, 4, None).validate()
    with pytest.raises(UsageError, match="below the vocabulary size"):
        _spec(21, 4, 20).validate()
    with pytest.raises(UsageError, match="does not match the config's vocab_size 21"):
        shard(_spec(21, 4, 24), "vocab", torch.zeros(22, 3), 0)
    with pytest.raises(UsageError, match="the shards hold 20 vocabulary rows, the spec says 24"):
        merge(_spec(21, 4, 24), "vocab", [torch.zeros(5, 3)] * 4)


def test_max_abs_diff_over_chunks_equals_the_whole_tensors_and_keeps_nan(monkeypatch):
    monkeypatch.setattr(verify, "DIFF_CHUNK_ELEMENTS", 7)  # 45 elements: 7 chunks, the last one short
    torch.manual_seed(0)
    a = torch.randn(5, 9)
    b = a.clone()
    b[4, 8] += 0.5  # in the last chunk
    assert verify.max_abs_diff(a, a) == 0.0
    assert verify.max_abs_diff(a, b) == (a.double() - b.double()).abs().max().item()
    b[0, 0] = float("nan")
    assert math.isnan(verify.max_abs_diff(a, b))
    assert verify.max_abs_diff(a.to(torch.bfloat16), a.to(torch.bfloat16).float()) == 0.0
