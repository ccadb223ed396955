"""The checkpoints GPU tools write, generated here by the tools themselves (torch DCP with FSDP2 and FSDP1,
DDP, torch.compile, sharded save_pretrained) on a gloo group of one rank in this process: names matched
against the model, round trips through NxD shards, optimizer moments, inspect, and what is refused."""

import json

import pytest
import torch
from checkpoint_checks import assert_moments, moments_by_name, round_trip
from checkpoint_models import bert, llama
from checkpoint_tools import compiled_torch_save, ddp_torch_save, fsdp1_sharded_dcp, fsdp2_dcp
from conftest import cli_in_process

from neurontrain.checkpoint.matching import check_loads, model_names
from neurontrain.checkpoint.migrate import MigrateOptions, migrate
from neurontrain.checkpoint.report import inspect_checkpoint
from neurontrain.errors import NeurontrainError, UsageError


def tiny(tmp_path, family, **kwargs):
    return llama(tmp_path, **kwargs) if family == "llama" else bert(tmp_path)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_fsdp2_dcp_with_optimizer_namespace(tmp_path, capsys, family):
    model, hf = tiny(tmp_path, family)
    src, ref, moments = fsdp2_dcp(tmp_path, model)
    result, back = round_trip(tmp_path, src, ref, "fsdp2", config=hf, with_optimizer=True)
    assert result["source"]["layout"] == "dcp" and result["source"]["prefix"] == "model."
    assert_moments(back, moments)
    report = inspect_checkpoint(src, hf)
    assert (report["layout"], report["prefix"], report["optimizer_state"]) == ("dcp", "model.", True)
    assert report["model_tensors"] == result["tensors"] == report["tensors"]
    code, out, _ = cli_in_process(capsys, "checkpoint", "verify", str(src), str(ref), "--config", str(hf))
    assert code == 0 and "EQUAL" in out and not out.startswith("0 tensors"), out


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_fsdp1_sharded_state_dict_through_dcp(tmp_path, family):
    model, _ = tiny(tmp_path, family)
    src, ref, moments = fsdp1_sharded_dcp(tmp_path, model)
    result, back = round_trip(tmp_path, src, ref, "fsdp1", config=ref, with_optimizer=True)
    assert result["source"]["prefix"] == "model." and result["optimizer"]
    assert inspect_checkpoint(src, ref)["layout"] == "dcp"
    assert_moments(back, moments)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_ddp_training_dict_with_id_keyed_optimizer(tmp_path, family):
    model, hf = tiny(tmp_path, family)
    src, ref, optimizer = ddp_torch_save(tmp_path, model)
    result, back = round_trip(tmp_path, src, ref, "ddp", config=hf, with_optimizer=True)
    assert result["source"]["layout"] == "torch" and inspect_checkpoint(src, hf)["layout"] == "torch"
    assert_moments(back, moments_by_name(model, optimizer))
    state = torch.load(src, weights_only=True)
    for key in ("state_dict", "module"):  # the other keys training dicts hold the model under
        torch.save({key: state["model"], "epoch": 1}, tmp_path / f"{key}.pt")
        round_trip(tmp_path, tmp_path / f"{key}.pt", ref, key, config=hf)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_torch_compile_names(tmp_path, family):
    model, hf = tiny(tmp_path, family, tied=True)
    src, ref = compiled_torch_save(tmp_path, model)
    assert next(iter(torch.load(src, weights_only=True)["model_state_dict"])).startswith("_orig_mod.")
    result, _ = round_trip(tmp_path, src, ref, "compiled", config=hf)
    assert result["source"]["prefix"] == ""
    report = inspect_checkpoint(src, hf)
    assert (report["layout"], report["prefix"], report["optimizer_state"]) == (
        "torch",
        "",
        False,
    )  # wrapper names are dropped before matching


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_sharded_and_plain_save_pretrained(tmp_path, family):
    model, hf = tiny(tmp_path, family)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    round_trip(tmp_path, tmp_path / "sharded", hf, "sharded")
    assert inspect_checkpoint(tmp_path / "sharded")["layout"] == "hf-sharded"
    assert inspect_checkpoint(hf)["layout"] == "hf"


def test_names_that_fit_no_mapping_or_several_exit_2_and_write_nothing(tmp_path, capsys):
    model, hf = llama(tmp_path)
    _, bert_dir = bert(tmp_path)
    state = model.state_dict()
    torch.save({"state_dict": {f"net.{k}": v for k, v in state.items()}}, tmp_path / "prefixed.pt")
    both = {**{f"model.{k}": v for k, v in state.items()}, **{f"ema.{k}": v for k, v in state.items()}}
    torch.save(both, tmp_path / "two-copies.pt")
    cases = [
        (
            [
                "migrate",
                str(tmp_path / "prefixed.pt"),
                str(tmp_path / "d1"),
                "--to",
                "neuron",
                "--config",
                str(bert_dir),
            ],
            "no mapping of its",
        ),
        (
            ["migrate", str(tmp_path / "two-copies.pt"), str(tmp_path / "d2"), "--to", "gpu", "--config", str(hf)],
            "in 2 ways",
        ),
        (["migrate", str(tmp_path / "prefixed.pt"), str(tmp_path / "d3"), "--to", "gpu"], "pass --config"),
    ]
    capsys.readouterr()  # drop the set-up's progress bars
    for args, message in cases:
        code, _, err = cli_in_process(capsys, "checkpoint", *args)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and message in lines[0], err[-1500:]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".d", "d1", "d2", "d3"))]
    # the prefix is found, never guessed: `net.` is stripped because that is what covers the model
    result = migrate(tmp_path / "prefixed.pt", tmp_path / "ok", MigrateOptions(to="gpu", config=hf))
    assert result["source"]["prefix"] == "net."


def test_strict_load_check_refuses_what_would_not_load(tmp_path):
    _, hf = llama(tmp_path)
    config = json.loads((hf / "config.json").read_text())
    shapes = dict(model_names(config).shapes)
    check_loads(config, shapes, "all of it")
    with pytest.raises(NeurontrainError, match="strict=True"):
        check_loads(config, {k: v for k, v in shapes.items() if "layers.3.mlp" not in k}, "a partial output")
    with pytest.raises(NeurontrainError, match="strict=True"):
        check_loads(config, {**shapes, "model.embed_tokens.weight": (7, 64)}, "a wrong shape")
    with pytest.raises(UsageError, match="does not exist"):
        inspect_checkpoint(tmp_path / "missing")
