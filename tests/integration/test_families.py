"""The model families users bring, each as a tiny model from its transformers config class's own defaults
(tests/families.py), trained on XLA:CPU as `run` trains it: unpacked and packed (or refused in one line), and
started from the TP 2 shards `checkpoint migrate` makes of its trained model. One fresh process runs every family
(tests/family_runs_worker.py); each family's checks are a test of their own. Migration round trips and packing's
per-document isolation are checked per family in the unit tier (test_family_rules.py,
test_packing_isolation.py). And a run whose loss turns NaN exits 1 within that step on XLA:CPU."""

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO
from families import FAMILIES, Family

pytestmark = pytest.mark.slow
TESTS = REPO / "tests"


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("families")
    proc = subprocess.run(
        [sys.executable, str(TESTS / "family_runs_worker.py"), str(out), *(f.model_type for f in FAMILIES), "nan-run"],
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": f"{TESTS}:{REPO}", "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"model_type"')]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("neurontrain: error: the loss is nan at step") == 1  # the NaN run's one line
    return {r["model_type"]: r for r in reports}


def _trained(result: dict, what: str) -> None:
    assert "error" not in result, f"{what}: {result.get('error')}"
    losses = result["losses"]
    assert losses and all(math.isfinite(v) for v in losses) and math.isfinite(result["eval_loss"]), what
    assert sum(losses[-5:]) < sum(losses[:5]), f"{what}: loss did not fall: {losses}"
    assert result["unexpected_graphs"] == 0, what
    assert result["compilations"] <= result["expected_graphs"], what  # graphs of an earlier run are cached


def _ids(family: Family) -> str:
    return family.model_type


@pytest.mark.parametrize("family", FAMILIES, ids=_ids)
def test_the_family_trains_with_its_config_defaults(family_runs, family: Family):
    _trained(family_runs[family.model_type]["unpacked"], f"{family.model_type} unpacked")


@pytest.mark.parametrize("family", FAMILIES, ids=_ids)
def test_the_family_packs_or_is_refused_in_one_line(family_runs, family: Family):
    packed = family_runs[family.model_type]["packed"]
    if family.packs:
        _trained(packed, f"{family.model_type} packed")
        assert packed["padding_fraction"] < family_runs[family.model_type]["unpacked"]["padding_fraction"]
    else:
        assert packed.get("exit_code") == 2 and "packing" in packed["error"], packed
        assert family.model_type in packed["error"] and "\n" not in packed["error"]


@pytest.mark.parametrize("family", FAMILIES, ids=_ids)
def test_a_run_starts_from_the_tp2_shards_of_the_family(family_runs, family: Family):
    result = family_runs[family.model_type]["from_tp2_shards"]
    assert result.get("equal") is True, result


def test_a_nan_loss_exits_1_within_its_step_and_publishes_nothing(family_runs):
    """`neurontrain run` at learning rate 1e8 on XLA:CPU (in the worker's process; its stderr line and exit code
    through the CLI's own error path, as every NeurontrainError)."""
    result = family_runs["nan-run"]
    losses = {int(step): loss for step, loss in result["losses"].items()}
    bad = max(losses)
    assert result["exit_code"] == 1 and not math.isfinite(losses[bad])
    assert all(math.isfinite(losses[s]) for s in losses if s < bad)
    assert result["checkpoints"][-1] == bad - 1  # the newest checkpoint is the last good step's
    assert "model" not in result["left"] and "summary.json" not in result["left"]
