"""Every recipe in recipes/ trains a few steps end to end on XLA:CPU, with its own precision, gradient
accumulation and compiler flags. Recipes that name a hub model or dataset get local stand-ins generated here
(tests/recipe_standins.py); nothing is downloaded. The tiny recipes train whole, as shipped, in test_training.py
and are not run again here. The recipes that name a hub model load it with `from_pretrained` and evaluate it at the
end: the path where a transformers release (5.25's hub kernels on by default) broke every pretrained run on XLA at its
first evaluation, while the config-built tiny recipes did not notice."""

from pathlib import Path

import pytest
from conftest import RECIPES, read_json, read_metrics, run_cli
from recipe_standins import standin_overrides

from neurontrain.recipe import load_recipe

STEPS = 3


@pytest.mark.parametrize(
    "recipe_path", [p for p in sorted(RECIPES.glob("*.yaml")) if not p.stem.startswith("tiny-")], ids=lambda p: p.stem
)
def test_shipped_recipe_trains_on_xla_cpu(tmp_path: Path, recipe_path: Path):
    recipe = load_recipe(recipe_path)
    overrides = standin_overrides(recipe, tmp_path)
    # only the length of the run changes (and the warm-up, which must stay shorter than the run)
    overrides += [
        "--set",
        f"train.max_steps={STEPS}",
        "--set",
        "train.schedule.warmup_steps=1",
        "--set",
        "train.log_every=1",
    ]
    out = tmp_path / "run"
    result = run_cli("run", str(recipe_path), *overrides, "--backend", "xla-cpu", "--output-dir", str(out))
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    summary = read_json(out / "summary.json")
    assert summary["backend"] == "xla-cpu" and summary["steps"] == STEPS
    assert summary["unexpected_graphs"] == 0, summary["unexpected"]
    assert summary["grad_accum"] == recipe.train.grad_accum
    packed = summary["bucket_mode"] == "packed"  # data.packing: auto, rows holding about data.batch_size samples
    batch = summary["per_worker_batch"] if packed else recipe.data.batch_size
    assert batch <= recipe.data.batch_size and summary["effective_batch"] == batch * recipe.train.grad_accum
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps[-1] == STEPS, steps
    assert summary["final_loss"] == summary["final_loss"] and summary["final_loss"] > 0  # finite, not NaN
    assert summary["eval_loss"] == summary["eval_loss"] and summary["eval_loss"] > 0  # evaluated at the end
    if recipe.model.pretrained is not None:  # the stand-in's architecture was trained and exported
        exported = read_json(out / "model" / "config.json")
        assert exported["hidden_size"] == read_json(tmp_path / "model" / "config.json")["hidden_size"] == 64


def test_pretrained_llama_trains_and_evaluates_on_native(tmp_path: Path):
    """The from_pretrained path on the native backend (torch.compile): loaded with hub kernels off, trained,
    evaluated, exported."""
    recipe_path = RECIPES / "llama-clm.yaml"
    overrides = standin_overrides(load_recipe(recipe_path), tmp_path)
    overrides += ["--set", "train.max_steps=2", "--set", "train.schedule.warmup_steps=1", "--set", "train.grad_accum=1"]
    out = tmp_path / "run"
    result = run_cli("run", str(recipe_path), *overrides, "--backend", "native", "--output-dir", str(out))
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    summary = read_json(out / "summary.json")
    assert summary["backend"] == "native" and summary["steps"] == 2
    assert summary["eval_loss"] == summary["eval_loss"] and summary["eval_loss"] > 0
    assert read_json(out / "model" / "config.json")["hidden_size"] == 64
