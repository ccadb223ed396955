"""The tiny SFT LoRA recipe as shipped, on XLA:CPU: its planned graphs only; peft's own PeftModel.from_pretrained
loads its adapter folder and gives the logits of the toolkit's final model; its merged model is peft's
merge_and_unload; its training checkpoints hold the adapters and their AdamW state only; SIGKILL mid-run then
resume gives a bit-identical adapter."""

import time
from pathlib import Path

import pytest
import torch
from conftest import RECIPES, read_json, read_metrics, run_cli, start_cli
from safetensors.torch import load_file

from neurontrain.recipe import load_recipe

pytestmark = pytest.mark.slow
RECIPE = RECIPES / "tiny-llama-sft-lora.yaml"
ARGS = [
    str(RECIPE),
    "--backend",
    "xla-cpu",
    "--no-preflight",
    "--set",
    "train.log_every=1",
    "--set",
    "train.max_steps=20",
]


@pytest.fixture(scope="module")
def shipped_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft-lora") / "run"
    result = run_cli("run", *ARGS, "--output-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _models(run: Path):
    """(the toolkit's final LoRA model rebuilt from the run's last checkpoint, the frozen base, the tokenizer)."""
    from transformers import AutoTokenizer

    from neurontrain.loop.checkpoints import latest_checkpoint, load_checkpoint
    from neurontrain.model.build import build_config, build_model
    from neurontrain.model.lora import load_weights

    recipe = load_recipe(RECIPE, ["runtime.backend=eager"])
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    config = build_config(recipe, tokenizer)
    trained = build_model(recipe, config)
    state, _ = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    load_weights(trained, state["model"])
    base = build_model(recipe.model_copy(update={"model": recipe.model.model_copy(update={"lora": None})}), config)
    return trained.eval(), base.eval(), tokenizer


def test_runs_its_planned_graphs_and_trains_on_the_answers(shipped_run: Path):
    summary = read_json(shipped_run / "summary.json")
    assert summary["unexpected_graphs"] == 0, summary["unexpected"]
    assert summary["data"]["format"] == "messages" and summary["data"]["loss_on"] == "assistant"
    trained, kept = summary["data"]["trained_tokens"]["train"], summary["data"]["tokens_kept"]
    assert 0 < trained < kept / 2  # the assistant turns only
    losses = [r["loss"] for r in read_metrics(shipped_run / "metrics.jsonl") if "loss" in r]
    assert sum(losses[-3:]) / 3 < 0.95 * sum(losses[:3]) / 3, losses  # 20 steps of a shipped 30
    assert summary["eval_loss"] < summary["first_loss"]


def test_peft_loads_the_adapter_and_the_merged_model_is_peft_merge(shipped_run: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trained, base, tokenizer = _models(shipped_run)
    ids = torch.randint(3, len(tokenizer), (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        assert not torch.equal(expected, base(input_ids=ids).logits)  # the adapters changed the model
        loaded = PeftModel.from_pretrained(base, shipped_run / "model").eval()
        assert (loaded(input_ids=ids).logits - expected).abs().max().item() < 1e-5
        merged_by_peft = loaded.merge_and_unload()
        merged = AutoModelForCausalLM.from_pretrained(shipped_run / "model-merged").eval()
        assert (merged(input_ids=ids).logits - merged_by_peft(input_ids=ids).logits).abs().max().item() < 1e-6
    saved = load_file(shipped_run / "model" / "adapter_model.safetensors")
    assert saved and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in saved)
    assert all(k.startswith("base_model.model.model.layers.") for k in saved)


def test_checkpoints_hold_the_adapters_only(shipped_run: Path):
    full = (shipped_run / "model-merged" / "model.safetensors").stat().st_size
    for checkpoint in (shipped_run / "checkpoints").iterdir():
        assert (checkpoint / "state.pt").stat().st_size < 0.05 * full


def test_sigkill_mid_run_then_resume_gives_the_same_adapter(tmp_path: Path, shipped_run: Path):
    out = tmp_path / "killed"
    proc = start_cli("run", *ARGS, "--output-dir", str(out))
    marker = out / "checkpoints" / "step_00000010" / "COMPLETE"
    deadline = time.time() + 300
    try:
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, "the run ended before it could be killed"
            time.sleep(0.05)
        proc.kill()
    finally:
        proc.communicate()
    assert not (out / "summary.json").exists()
    result = run_cli("run", *ARGS, "--output-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_json(out / "summary.json")["resumed_from_step"] in (10, 20)
    mine, theirs = (load_file(run / "model" / "adapter_model.safetensors") for run in (out, shipped_run))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
