"""The smoke tier `scripts/check-newest` runs in a scratch environment holding the newest releases the ranges
allow: what a user's first hour touches, each piece through the CLI in a process of its own. Every shipped recipe
trains from a local `save_pretrained` checkpoint (tests/recipe_standins.py: nothing downloaded) and evaluates, on
XLA:CPU, eager and native; a migrate round trip is verified tensor by tensor and by logits; a report page is written.
Not part of the suite (testpaths): the suite runs against the lock, this tier against what the lock would become."""

from pathlib import Path

import pytest
from conftest import RECIPES, read_json, run_cli
from recipe_standins import RECORDS, save_standin_model, standin_overrides, standin_records

from neurontrain.recipe import load_recipe

STEPS = 2
BACKENDS = ("xla-cpu", "eager", "native")


def _pretrained_overrides(recipe_path: Path, workdir: Path) -> list[str]:
    """The recipe pointed at a local save_pretrained model (and its data at a local file where it names one): the
    tiny recipes, which build their models from config classes, get the stand-in model of their task instead."""
    recipe = load_recipe(recipe_path)
    if recipe.model.pretrained is not None:
        return standin_overrides(recipe, workdir)
    model_dir = workdir / "model"
    corpus = [r[recipe.data.text_field] for r in standin_records(recipe, RECORDS)]
    save_standin_model(recipe, model_dir, corpus)
    sets = ["model.config=null", f"model.pretrained={model_dir}"]
    sets += ["tokenizer.word_level=null", f"tokenizer.pretrained={model_dir}"]
    return [arg for item in sets for arg in ("--set", item)]


def _train(recipe_path: Path, backend: str, workdir: Path) -> Path:
    overrides = _pretrained_overrides(recipe_path, workdir)
    overrides += ["--set", f"train.max_steps={STEPS}", "--set", "train.schedule.warmup_steps=1"]
    overrides += ["--set", "train.grad_accum=1", "--set", "train.eval_at_end=true", "--set", "data.eval_samples=8"]
    out = workdir / "run"
    result = run_cli("run", str(recipe_path), *overrides, "--backend", backend, "--output-dir", str(out))
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe_path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_recipe_trains_from_pretrained_and_evaluates(tmp_path: Path, recipe_path: Path, backend: str):
    out = _train(recipe_path, backend, tmp_path)
    summary = read_json(out / "summary.json")
    assert summary["backend"] == backend and summary["steps"] == STEPS
    assert summary["final_loss"] == summary["final_loss"] and summary["final_loss"] > 0
    assert summary["eval_loss"] == summary["eval_loss"] and summary["eval_loss"] > 0
    assert (out / "model" / "config.json").exists()


def test_migrate_round_trip_and_report(tmp_path: Path):
    out = _train(RECIPES / "tiny-llama-clm.yaml", "eager", tmp_path)
    model = out / "model"
    shards, back = tmp_path / "tp2", tmp_path / "back"
    for args in (
        ("checkpoint", "migrate", str(model), str(shards), "--to", "neuron", "--tp", "2"),
        ("checkpoint", "migrate", str(shards), str(back), "--to", "gpu", "--config", str(model / "config.json")),
        ("checkpoint", "verify", str(model), str(back), "--logits", str(model)),
        ("report", str(out), "-o", str(tmp_path / "report.html")),
    ):
        result = run_cli(*args)
        assert result.returncode == 0, (args, result.returncode, result.stderr[-3000:])
    page = (tmp_path / "report.html").read_text()
    assert "<svg" in page and "tiny-llama-clm" in page
