"""Both tiny recipes trained on XLA:CPU with data.packing: on: almost no padding, one graph per step kind, a
falling loss, and tiny BERT's eval accuracy beside the unpacked run's at the same number of seen samples."""

import math

import pytest
from conftest import RECIPES, read_json, read_metrics, run_cli

from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe

pytestmark = pytest.mark.slow

BERT = RECIPES / "tiny-bert-classification.yaml"
LLAMA = RECIPES / "tiny-llama-clm.yaml"
QUIET = ["checkpoint.every=0", "checkpoint.save_final=false"]
# 512 eval reviews: one point of accuracy is five reviews
BERT_EVAL = [*QUIET, "data.eval_samples=512"]
# 4 packed rows of about 3.5 reviews: about as many samples a step as the unpacked recipe's 16
BERT_PACKED = [*BERT_EVAL, "data.packing=on", "data.batch_size=4"]


def _sets(overrides: list[str]) -> list[str]:
    return [arg for value in overrides for arg in ("--set", value)]


def _train(tmp_path, recipe, overrides: list[str]) -> dict:
    out = tmp_path / "run"
    result = run_cli("run", str(recipe), "--output-dir", str(out), "--no-preflight", *_sets(overrides))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(out / "summary.json")
    summary["losses"] = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    return summary


def _packed_steps_for(samples: int) -> int:
    """Steps of BERT_PACKED whose planned batches hold about `samples` samples (the plan is pure logic)."""
    plan = make_plan(load_recipe(BERT, [*BERT_PACKED, "train.max_steps=100"]), "eager")
    per_step = plan.samples_trained() / 100
    return math.floor(samples / per_step + 0.5)


@pytest.fixture(scope="module")
def bert_runs(tmp_path_factory) -> tuple[dict, dict]:
    unpacked = _train(tmp_path_factory.mktemp("unpacked"), BERT, [*BERT_EVAL, "data.packing=off"])
    steps = _packed_steps_for(unpacked["samples_trained"])
    packed = _train(tmp_path_factory.mktemp("packed"), BERT, [*BERT_PACKED, f"train.max_steps={steps}"])
    return unpacked, packed


def _assert_packed_run(summary: dict) -> None:
    assert summary["bucket_mode"] == "packed"
    assert summary["padding_fraction"] <= 0.05
    assert summary["compilations"] == 3  # set-up, train, eval: one graph per step kind
    assert summary["unexpected_graphs"] == 0 and summary["hidden_host_syncs"] == []
    losses = summary["losses"]
    assert sum(losses[-2:]) < 0.7 * sum(losses[:2]), losses


def test_packed_bert_sees_the_same_samples_and_scores_within_a_point(bert_runs):
    unpacked, packed = bert_runs
    _assert_packed_run(packed)
    assert abs(packed["samples_trained"] - unpacked["samples_trained"]) <= 16
    assert unpacked["padding_fraction"] > 0.5
    assert abs(packed["eval_accuracy"] - unpacked["eval_accuracy"]) <= 0.01, (packed, unpacked)
    assert packed["eval_loss"] < packed["first_loss"]


def test_packed_llama_trains_with_one_graph_per_step_kind(tmp_path):
    packed = _train(tmp_path, LLAMA, [*QUIET, "data.packing=on"])
    _assert_packed_run(packed)
    assert packed["samples_trained"] > 2 * packed["steps"] * packed["per_worker_batch"]
    assert packed["eval_loss"] < packed["first_loss"]
