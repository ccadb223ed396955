"""Vocabulary padding in `checkpoint migrate`: vocabularies that TP does not divide are zero-padded on the way
to Neuron and stripped on the way back, bit-identically, with logits over the real vocabulary unchanged."""

import json

import pytest
import torch
from checkpoint_models import HIDDEN, VOCAB, bert, hf_tensors, llama, rank_file

from neurontrain.checkpoint.migrate import MigrateOptions, migrate, open_checkpoint
from neurontrain.checkpoint.verify import compare, logits_diff


@pytest.mark.parametrize("vocab, padded", [(21, 24), (50, 52)])
@pytest.mark.parametrize("fuse", [False, True])
def test_padded_vocabulary_round_trips_through_the_cli(tmp_path, capsys, vocab, padded, fuse):
    """TP 4 of a vocabulary it does not divide: padded automatically, stripped on the way back, bit-identical,
    logits over the real vocabulary equal (the CLI's entry point in this process, as a shell would call it)."""
    from neurontrain.cli import main

    _, src = llama(tmp_path, vocab=vocab)
    nxd, back = tmp_path / "nxd", tmp_path / "back"
    capsys.readouterr()
    assert (
        main(
            [
                "checkpoint",
                "migrate",
                str(src),
                str(nxd),
                "--to",
                "neuron",
                "--tp",
                "4",
                *(["--fuse-qkv"] if fuse else []),
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["vocab_padding"]
    assert report["vocab_size"] == vocab and report["padded_vocab_size"] == padded
    assert report["zero_rows"] == padded - vocab and "automatic" in report["reason"]
    spec = json.loads((nxd / "checkpoint_spec.json").read_text())
    assert (spec["vocab_size"], spec["padded_vocab_size"]) == (vocab, padded)
    assert json.loads((nxd / "config.json").read_text())["vocab_size"] == vocab  # the real vocabulary
    original = hf_tensors(src)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        pieces = [rank_file(nxd, r, 0)[name] for r in range(4)]
        assert all(p.shape == (padded // 4, HIDDEN) for p in pieces), name
        stacked = torch.cat(pieces)
        assert torch.equal(stacked[:vocab], original[name]) and not stacked[vocab:].any(), name

    assert main(["checkpoint", "migrate", str(nxd), str(back), "--to", "gpu"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["vocab_padding_stripped"] == padded - vocab
    restored = hf_tensors(back)
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[n], restored[n]) for n in original)
    for other in (back, nxd):  # the shards read directly are stripped too
        assert main(["checkpoint", "verify", str(src), str(other), "--logits", str(src)]) == 0
        out = capsys.readouterr().out
        assert "EQUAL" in out and "logits max abs diff 0" in out, out


def test_padded_vocabulary_with_optimizer_and_pipeline(tmp_path):
    model, src = llama(tmp_path, vocab=21)
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "train.pt")
    nxd, back = tmp_path / "nxd", tmp_path / "back"
    result = migrate(
        tmp_path / "train.pt",
        nxd,
        MigrateOptions(to="neuron", tp=4, pp=2, with_optimizer=True, config=src, pad_vocab_multiple=16),
    )
    assert result["vocab_padding"]["padded_vocab_size"] == 32 and "multiple-of 16" in result["vocab_padding"]["reason"]
    last = torch.load(nxd / "optim" / "dp_rank_00_tp_rank_03_pp_rank_00.pt", weights_only=True)
    embed = last["model.embed_tokens.weight"]
    assert embed["exp_avg"].shape == (8, HIDDEN) and not embed["exp_avg"][5:].any()  # rows 21..31 are padding
    lm_head = torch.load(nxd / "optim" / "dp_rank_00_tp_rank_03_pp_rank_01.pt", weights_only=True)["lm_head.weight"]
    assert lm_head["exp_avg_sq"].shape == (8, HIDDEN) and not lm_head["exp_avg_sq"][5:].any()
    migrate(nxd, back, MigrateOptions(to="gpu", with_optimizer=True))
    reference = open_checkpoint(tmp_path / "train.pt", src)  # the weights after the optimizer step
    assert compare(reference, open_checkpoint(back))["equal"]
    restored = torch.load(back / "optimizer.pt", weights_only=True)
    index = dict(zip(restored["param_groups"][0]["param_names"], restored["param_groups"][0]["params"]))
    original = optimizer.state_dict()["state"]
    for i, (name, _) in enumerate(model.named_parameters()):
        assert torch.equal(original[i]["exp_avg_sq"], restored["state"][index[name]]["exp_avg_sq"]), name
    assert logits_diff(reference, open_checkpoint(back), json.loads((src / "config.json").read_text())) == 0.0


def test_padded_vocabulary_with_tied_embeddings(tmp_path):
    _, src = llama(tmp_path, tied=True, vocab=50)
    nxd = tmp_path / "nxd"
    migrate(src, nxd, MigrateOptions(to="neuron", tp=8, pp=2, fuse_qkv=True))
    assert rank_file(nxd, 7, 0)["model.embed_tokens.weight"].shape == (7, HIDDEN)
    assert "lm_head.weight" not in rank_file(nxd, 0, 1)
    migrate(nxd, tmp_path / "back", MigrateOptions(to="gpu"))
    reference, back = open_checkpoint(src), open_checkpoint(tmp_path / "back")
    assert compare(reference, back)["equal"]
    assert logits_diff(reference, back, json.loads((src / "config.json").read_text())) == 0.0


def test_divisible_vocabulary_gets_no_padding_unless_asked(tmp_path):
    _, src = llama(tmp_path)
    plain = migrate(src, tmp_path / "plain", MigrateOptions(to="neuron", tp=4))
    assert plain["vocab_padding"] is None
    spec = json.loads((tmp_path / "plain" / "checkpoint_spec.json").read_text())
    assert spec["vocab_size"] == spec["padded_vocab_size"] == VOCAB
    assert rank_file(tmp_path / "plain", 3, 0)["model.embed_tokens.weight"].shape == (VOCAB // 4, HIDDEN)
    asked = migrate(src, tmp_path / "asked", MigrateOptions(to="neuron", tp=4, pad_vocab_multiple=96))
    assert asked["vocab_padding"]["padded_vocab_size"] == 192
    assert rank_file(tmp_path / "asked", 3, 0)["lm_head.weight"].shape == (48, HIDDEN)
    migrate(tmp_path / "asked", tmp_path / "back", MigrateOptions(to="gpu"))
    assert compare(open_checkpoint(src), open_checkpoint(tmp_path / "back"))["equal"]


def test_bert_padded_vocabulary_round_trip_and_logits(tmp_path):
    _, src = bert(tmp_path, vocab=21)
    nxd, back = tmp_path / "nxd", tmp_path / "back"
    assert migrate(src, nxd, MigrateOptions(to="neuron", tp=4))["vocab_padding"]["padded_vocab_size"] == 24
    assert rank_file(nxd, 3, 0)["bert.embeddings.word_embeddings.weight"].shape == (6, HIDDEN)
    migrate(nxd, back, MigrateOptions(to="gpu"))
    assert compare(open_checkpoint(src), open_checkpoint(back))["equal"]
    config = json.loads((src / "config.json").read_text())
    assert logits_diff(open_checkpoint(src), open_checkpoint(nxd), config) == 0.0
