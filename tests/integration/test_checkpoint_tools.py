"""Checkpoints written by Lightning (Trainer .ckpt, FSDP sharded .ckpt/ directory), the transformers Trainer and
accelerate, generated here by those tools on CPU: each migrates --to neuron --tp 2 and back and equals the
model's own save_pretrained; optimizer moments carried by name; inspect names each layout; verify reads the
DCP, Lightning and HF forms of the same weights as EQUAL (through the CLI, in a process)."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_checks import assert_moments, round_trip
from checkpoint_models import bert, llama
from checkpoint_tools import (
    accelerate_state,
    deepspeed_zero_cases,
    hf_trainer,
    in_a_process_without_xla,
    lightning_ckpt,
)
from conftest import cli_in_process

from neurontrain.checkpoint.report import inspect_checkpoint

pytest.importorskip("lightning")


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_lightning_ckpt(tmp_path, family):
    model, hf = (llama if family == "llama" else bert)(tmp_path)
    src, ref = lightning_ckpt(tmp_path, model)
    result, back = round_trip(tmp_path, src, ref, "lightning", config=hf, with_optimizer=True)
    assert result["source"]["layout"] == "lightning" and result["source"]["prefix"] == "model."
    state = torch.load(src, weights_only=True)["optimizer_states"][0]
    assert_moments(back, {n: state["state"][i] for i, (n, _) in enumerate(model.named_parameters())})
    assert inspect_checkpoint(src, hf)["layout"] == "lightning"


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_lightning_fsdp_sharded_directory(tmp_path, family):
    _, hf = (llama if family == "llama" else bert)(tmp_path)
    src, ref = in_a_process_without_xla(lightning_ckpt, tmp_path, family, sharded=True)
    assert src.is_dir() and (src / "meta.pt").is_file()
    result, back = round_trip(tmp_path, src, ref, "lightning-fsdp", config=hf, with_optimizer=True)
    assert result["source"]["layout"] == "lightning-sharded" and result["source"]["prefix"] == "model.model."
    report = inspect_checkpoint(src, hf)
    assert report["layout"] == "lightning-sharded" and report["optimizer_state"]
    # the moments as torch's own converter reads the DCP files back (Lightning's FSDP names them by parameter)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(src, tmp_path / "lightning-fsdp.pt")
    state = torch.load(tmp_path / "lightning-fsdp.pt", weights_only=False)["optimizer_0"]["state"]
    assert_moments(back, {name.removeprefix("model."): moments for name, moments in state.items()})


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_hf_trainer_checkpoint(tmp_path, family):
    model, _ = (llama if family == "llama" else bert)(tmp_path)
    src, ref = in_a_process_without_xla(hf_trainer, tmp_path, family)
    result, back = round_trip(tmp_path, src, ref, "trainer", with_optimizer=True)
    assert result["source"]["layout"] == "hf-trainer"
    assert inspect_checkpoint(src)["layout"] == "hf-trainer"
    # the Trainer's optimizer holds no names: its groups are the weight-decayed parameters, then the others
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    names = [n for n, _ in model.named_parameters()]
    order = [n for n in names if n in decay] + [n for n in names if n not in decay]
    state = torch.load(src / "optimizer.pt", weights_only=True)["state"]
    assert_moments(back, {n: state[i] for i, n in enumerate(order)})


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_accelerate_save_state(tmp_path, family):
    model, hf = (llama if family == "llama" else bert)(tmp_path)
    src, ref = in_a_process_without_xla(accelerate_state, tmp_path, family)
    result, back = round_trip(tmp_path, src, ref, "accelerate", config=hf, with_optimizer=True)
    assert result["source"]["layout"] == "accelerate"
    optimizer_state = torch.load(src / "optimizer.bin", weights_only=True)
    expected = {n: optimizer_state["state"][i] for i, (n, _) in enumerate(model.named_parameters())}
    assert_moments(back, expected)
    assert inspect_checkpoint(src, hf)["layout"] == "accelerate"


def test_cli_inspect_and_verify_across_forms(tmp_path, capsys):
    """The same weights as a Lightning .ckpt, DCP and HF safetensors: verify says EQUAL for each pair."""
    model, hf = llama(tmp_path)
    ckpt, ref = lightning_ckpt(tmp_path, model)
    dcp.save({"model": model.state_dict(), "step": torch.tensor(1)}, checkpoint_id=str(tmp_path / "dcp"))
    for a, b in ((tmp_path / "dcp", ref), (ckpt, ref), (tmp_path / "dcp", ckpt)):
        code, out, err = cli_in_process(
            capsys, "checkpoint", "verify", str(a), str(b), "--config", str(hf), "--logits", str(hf)
        )
        assert code == 0 and "EQUAL" in out and not out.startswith("0 tensors"), out + err
    code, out, err = cli_in_process(capsys, "checkpoint", "inspect", str(ckpt), "--config", str(hf), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["layout"] == "lightning" and report["prefix"] == "model." and report["optimizer_state"]
    code, out, err = cli_in_process(capsys, "checkpoint", "inspect", str(tmp_path / "dcp"))
    assert code == 0 and "config needed" in out, out + err


DEEPSPEED_CASES = [("llama", 1, 2), ("llama", 2, 3), ("llama", 3, 2), ("bert", 1, 3), ("bert", 2, 2), ("bert", 3, 3)]


@pytest.fixture(scope="module")
def deepspeed_checkpoints(tmp_path_factory) -> dict:
    """Every case's DeepSpeed checkpoint, written by one process (DeepSpeed and each family's model set up once):
    {(family, stage, world): (ds dir, reference dir, DeepSpeed's own moments)}."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("deepspeed")
    paths = in_a_process_without_xla(deepspeed_zero_cases, root, None, cases=DEEPSPEED_CASES)
    return {case: paths[3 * i : 3 * i + 3] for i, case in enumerate(DEEPSPEED_CASES)}


@pytest.mark.parametrize("family, stage, world", DEEPSPEED_CASES)
def test_deepspeed_zero(tmp_path, family, stage, world, deepspeed_checkpoints):
    """Every stage for both families (stage 3's weight files hold no whole weights). Two or three
    data-parallel ranks, so every partition is a real part; with three, DeepSpeed pads (stage 2: the last rank's
    group, stage 3: parameters whose size three does not divide). The moments migrated from the partitions equal,
    tensor by tensor, those DeepSpeed's engine assembles itself."""
    _, hf = (llama if family == "llama" else bert)(tmp_path)
    src, ref, moments = deepspeed_checkpoints[family, stage, world]
    assert len(list((src / "global_step1").glob("*_optim_states.pt"))) == world
    result, back = round_trip(tmp_path, src, ref, f"zero{stage}", config=hf, with_optimizer=True)
    assert result["source"]["layout"] == "deepspeed" and result["optimizer"]
    engine = torch.load(moments, weights_only=True)
    assert_moments(back, engine["moments"])
    steps = {float(s["step"]) for s in torch.load(back / "optimizer.pt", weights_only=True)["state"].values()}
    assert steps == {float(engine["global_steps"])}, steps
    report = inspect_checkpoint(src / "global_step1", hf)
    assert report["layout"] == "deepspeed" and report["optimizer_state"]
