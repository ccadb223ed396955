"""The model families users bring, each as a tiny model from its transformers config class's own defaults
(tests/families.py), trained on XLA:CPU as `run` trains it: unpacked and packed (or refused in one line), and
started from the TP 2 shards `checkpoint migrate` makes of its trained model. One fresh process runs every family
(tests/family_runs_worker.py); each family's checks are a test of their own. Migration round trips and packing's
per-document isolation are checked per family in the unit tier (test_family_sharding.py,
test_packing_isolation.py). And a run whose loss turns NaN exits 1 within that step on XLA:CPU."""

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import RECIPES, REPO, run_cli
from families import FAMILIES, Family

pytestmark = pytest.mark.slow
TESTS = REPO / "tests"


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("families")
    proc = subprocess.run(
        [sys.executable, str(TESTS / "family_runs_worker.py"), str(out), *(f.model_type for f in FAMILIES)],
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": f"{TESTS}:{REPO}", "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"model_type"')]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["model_type"]: r for r in reports}


def _trained(result: dict, what: str) -> None:
    assert "error" not in result, f"{what}: {result.get('error')}"
    losses = result["losses"]
    assert losses and all(math.isfinite(v) for v in losses) and math.isfinite(result["eval_loss"]), what
    assert losses[-1] < losses[0], f"{what}: loss did not fall: {losses}"
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


def test_a_nan_loss_exits_1_within_its_step_and_publishes_nothing(tmp_path):
    out = tmp_path / "nan"
    steps = ["train.max_steps=8", "train.log_every=1", "checkpoint.every=1", "train.schedule.warmup_steps=1"]
    overrides = [*steps, "train.optimizer.lr=1e6", "data.train_samples=256", "data.max_length=64"]
    proc = run_cli(
        "run", str(RECIPES / "tiny-bert-classification.yaml"), "--output-dir", str(out), "--no-preflight",
        *(a for o in overrides for a in ("--set", o)),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("neurontrain: error:")]
    assert len(error) == 1 and "Traceback" not in proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    bad = max(losses)
    assert not math.isfinite(losses[bad]) and all(math.isfinite(losses[s]) for s in losses if s < bad)
    assert f"the loss is {losses[bad]} at step {bad}" in error[0]
    saved = sorted(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").iterdir())
    assert saved[-1] == bad - 1 and not (out / "model").exists() and not (out / "summary.json").exists()
