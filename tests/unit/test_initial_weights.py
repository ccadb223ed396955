"""`run --init-from`: weights from NxD shards or GPU checkpoints load into the run's model exactly."""

import pytest
import torch
from checkpoint_models import bert, llama

from neurontrain.checkpoint.initial import load_initial_weights
from neurontrain.checkpoint.migrate import MigrateOptions, migrate
from neurontrain.errors import UsageError


def _fresh_like(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return type(model)(model.config)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize(("tp", "fuse", "tied"), [(2, False, False), (4, True, False), (8, False, True)])
def test_nxd_shards_load_bit_identical_to_the_hf_weights(tmp_path, tp, fuse, tied):
    original, hf_dir = llama(tmp_path, tied=tied)
    nxd = tmp_path / "nxd"
    migrate(hf_dir, nxd, MigrateOptions(to="neuron", tp=tp, fuse_qkv=fuse))
    model = _fresh_like(original, seed=1)
    assert not torch.equal(model.model.embed_tokens.weight, original.model.embed_tokens.weight)
    load_initial_weights(model, nxd)
    _assert_same_weights(model, original)
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_hf_and_bf16_shards_load_like_from_pretrained(tmp_path):
    original, hf_dir = bert(tmp_path)
    model = _fresh_like(original, seed=3)
    load_initial_weights(model, hf_dir)
    _assert_same_weights(model, original)

    nxd = tmp_path / "nxd16"
    migrate(hf_dir, nxd, MigrateOptions(to="neuron", tp=2, dtype="bf16"))
    load_initial_weights(model, nxd)
    for name, tensor in original.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor.to(torch.bfloat16).to(tensor.dtype)), name


def test_another_model_is_refused_with_one_line(tmp_path):
    _, hf_dir = llama(tmp_path)
    nxd = tmp_path / "nxd"
    migrate(hf_dir, nxd, MigrateOptions(to="neuron", tp=2))
    other, _ = llama(tmp_path, vocab=256, name="other")
    with pytest.raises(UsageError, match="embed_tokens.weight is \\[128, 64\\] there and \\[256, 64\\]"):
        load_initial_weights(other, nxd)
    bert_model, _ = bert(tmp_path)
    with pytest.raises(UsageError, match="tensors do not fit the recipe's model"):
        load_initial_weights(bert_model, hf_dir)
