"""Lightning data parallel under torchrun (`neurontrain run --lightning`): the example script, unchanged, as two
workers of 8 rows matches one worker of 16 on the same global batches; a worker killed with SIGKILL is restarted
(`--max-restarts 1`) and the fit resumes from Lightning's own last.ckpt."""

import json

import pytest
import torch
from conftest import REPO, read_json, run_cli, run_killing_a_worker

pytestmark = pytest.mark.slow

SCRIPT = REPO / "examples" / "lightning_tiny.py"
MATRIX = REPO / "tests" / "lightning_matrix.py"
STEPS = 10  # one epoch of 160 samples in global batches of 16


def _script(out, rows: int, steps: int = STEPS, *extra: str) -> str:
    return " ".join(
        [str(SCRIPT), "--max-steps", str(steps), "--batch-size", str(rows), "--accumulate", "1"]
        + ["--output-dir", str(out), "--no-preflight", *extra]
    )


def test_two_workers_match_one_worker_on_the_same_global_batches(tmp_path):
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        result = run_cli("run", "--lightning", _script(out, 16 // workers), "--nproc-per-node", str(workers))
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = (read_json(tmp_path / f"w{n}" / "summary.json") for n in (1, 2))
    assert len(one["step_losses"]) == len(two["step_losses"]) == STEPS
    worst = max(abs(a - b) / abs(a) for a, b in zip(one["step_losses"], two["step_losses"]))
    print(f"Lightning 2 workers x 8 vs 1 x 16: largest relative step-loss difference {worst:.2e}")
    assert worst <= 1e-3
    assert two["step_losses"][-1] < two["step_losses"][0]
    assert (two["world_size"], two["effective_batch"]) == (2, 16)
    assert two["unexpected_graphs"] == 0 and two["compilations"] == two["expected_graphs"]
    assert not two["hidden_host_syncs"]


def test_two_workers_logging_with_sync_dist_compile_only_their_plan_with_no_hidden_sync(tmp_path):
    """The matrix's sync_dist module (tests/lightning_matrix.py) as 2 workers: each step's `sync_dist=True` values
    are read in one transfer and reduced in one collective after the step's sync, not read inside the step (which
    launched the step's graph so far: a hidden host sync per logged key per step)."""
    out = tmp_path / "matrix"
    result = run_cli("run", "--lightning", f"{MATRIX} --output-dir {out} --steps 6 sync_dist", "--nproc-per-node", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    fit = json.loads((out / "matrix.json").read_text())["sync_dist"]
    summary = fit["summary"]
    assert fit["error"] is None, fit["error"]
    assert summary["world_size"] == 2 and summary["unexpected_graphs"] == 0, summary["unexpected"]
    assert summary["hidden_host_syncs"] == []
    assert 0 < fit["at_n"] == fit["at_2n"]
    print(f"Lightning sync_dist, 2 workers: {summary['host_reads_per_step']} host reads per step")
    # measured 8.7 per step (accumulation 2): per micro-batch its sync_dist values in one transfer, the rest as
    # without sync_dist (the gradients, the bar, Lightning's SIGTERM flag, a validation run's epoch values)
    assert summary["host_reads"] <= 9 * fit["steps"] + 4 * fit["validation_runs"]


def test_a_killed_worker_restarts_and_resumes_from_lightnings_checkpoint(tmp_path):
    out = tmp_path / "killed"
    last = out / "checkpoints" / "last.ckpt"
    args = ["run", "--lightning", _script(out, 8, 2 * STEPS, "--resume"), "--nproc-per-node", "2"]
    code, stderr = run_killing_a_worker([*args, "--max-restarts", "1"], out, STEPS, marker=last)
    assert code == 0, stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert (summary["restarts"], summary["resumed_from_step"], summary["steps"]) == (1, STEPS, STEPS)
    assert summary["unexpected_graphs"] == 0
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 2 * STEPS
    assert len(json.loads((out / "losses.json").read_text())) == STEPS  # the restarted fit's batches only


def test_a_failing_preflight_exits_3_before_step_1(tmp_path):
    """Each worker's device checks (and the collective checks between them) run before step 1: a device count
    the workers do not see fails them, one line, exit 3, nothing trained."""
    out = tmp_path / "out"
    script = f"{SCRIPT} --max-steps 4 --output-dir {out} --expected-devices 4"
    result = run_cli("run", "--lightning", script, "--nproc-per-node", "2", timeout=300)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "device count" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("neurontrain: error: worker rank")
    assert "Traceback" not in result.stderr
    assert not (out / "losses.json").exists() and not (out / "checkpoints").exists()
