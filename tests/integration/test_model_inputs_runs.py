"""Model inputs decided by what the model accepts, on XLA:CPU: Mistral with its config defaults
(`sliding_window: 4096`, which crashed on XLA while the training forward built a KV cache) trains packed and
unpacked, and DeBERTa-v2 (which reads its mask as 0/1, so a 4D additive mask zeroed its tokens) trains unpacked
with finite, falling losses; each without an unexpected graph. Packed BERT on the native backend runs the
compiled model without a graph beyond the plan's."""

import math

import pytest
from conftest import RECIPES, read_json, read_metrics, run_cli

pytestmark = pytest.mark.slow

SHORT = ["checkpoint.every=0", "checkpoint.save_final=false", "train.log_every=1", "data.eval_samples=16"]
MISTRAL = [*SHORT, "model.config.model_type=mistral", "train.max_steps=4", "train.schedule.warmup_steps=1"]
DEBERTA = [*SHORT, "model.config.model_type=deberta-v2", "train.max_steps=8", "train.schedule.warmup_steps=1"]


def _train(tmp_path, recipe: str, overrides: list[str]) -> dict:
    out = tmp_path / "run"
    sets = [arg for value in overrides for arg in ("--set", value)]
    result = run_cli("run", str(RECIPES / recipe), "--output-dir", str(out), "--no-preflight", *sets)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(out / "summary.json")
    summary["losses"] = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert summary["unexpected_graphs"] == 0 and summary["compilations"] == summary["expected_graphs"], summary
    assert all(math.isfinite(loss) for loss in summary["losses"]), summary["losses"]
    return summary


@pytest.mark.parametrize("packing", ["off", "on"])
def test_mistral_trains_with_its_sliding_window_default(tmp_path, packing: str):
    summary = _train(tmp_path, "tiny-llama-clm.yaml", [*MISTRAL, f"data.packing={packing}"])
    assert summary["bucket_mode"] == ("packed" if packing == "on" else "auto")
    assert summary["losses"][-1] < summary["losses"][0], summary["losses"]


def test_deberta_v2_trains_unpacked_with_finite_falling_losses(tmp_path):
    summary = _train(tmp_path, "tiny-bert-classification.yaml", DEBERTA)
    losses = summary["losses"]
    assert sum(losses[-2:]) < sum(losses[:2]), losses


def test_packed_bert_on_native_compiles_only_the_planned_graphs(tmp_path):
    """The packed classifier runs the compiled model itself (its hidden states captured by hooks installed
    before the compile): no graph beyond the plan's."""
    overrides = [*SHORT, "data.packing=on", "data.batch_size=4", "train.max_steps=4", "train.schedule.warmup_steps=1"]
    out = tmp_path / "run"
    sets = [arg for value in overrides for arg in ("--set", value)]
    args = ("run", str(RECIPES / "tiny-bert-classification.yaml"), "--backend", "native", "--output-dir", str(out))
    result = run_cli(*args, "--no-preflight", *sets)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["bucket_mode"] == "packed" and summary["unexpected_graphs"] == 0, summary
    assert summary["compilations"] == summary["expected_graphs"], summary
