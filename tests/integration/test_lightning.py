"""neurontrain.lightning on XLA:CPU with examples/lightning_tiny.py (an unchanged LightningModule: automatic
optimization, prog_bar logging, validation, a dynamic-padding loader, ModelCheckpoint, accumulation 2, clipping,
a per-step LR schedule): only the planned graphs, the same count on a short and a longer run, no hidden host
syncs, the losses of eager CPU Lightning; plain Lightning with a bare shim compiles more; the guard stops on an
unplanned shape and names an `.item()` in `training_step`; a failed preflight exits 3.

The runs are module-scoped, shared by the assertions, and run two at a time (two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "lightning_tiny.py"
SHORT, LONG = 11, 21  # validation every 10 steps (an epoch): the short run already has one after training began


def _start(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PJRT_DEVICE": "CPU"}
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--output-dir", str(out), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, out: Path) -> dict:
    stdout, stderr = proc.communicate(timeout=600)
    summary = out / "summary.json"
    return {
        "rc": proc.returncode,
        "stderr": stderr,
        "out": out,
        "summary": json.loads(summary.read_text()) if summary.is_file() else None,
        "losses": json.loads((out / "losses.json").read_text()) if (out / "losses.json").is_file() else None,
    }


RUNS = {  # name: arguments; longest first (they run two at a time: two cores)
    "long": ["--max-steps", str(LONG)],
    "short": ["--max-steps", str(SHORT)],
    "plain": ["--max-steps", "3", "--plain"],
    "item": ["--max-steps", "2", "--item", "--no-preflight"],
    "eager": ["--max-steps", str(SHORT), "--eager"],
    "fail": ["--max-steps", "3", "--buckets", "16,32", "--recompile-guard", "fail"],
    "preflight": ["--max-steps", "2", "--expected-devices", "4"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of this module, two processes at a time."""
    base = tmp_path_factory.mktemp("lightning")
    pending, running, done = list(RUNS.items()), {}, {}
    while pending or running:
        while pending and len(running) < 2:
            name, args = pending.pop(0)
            running[name] = (_start(base / name, *args), base / name)
        name = next(iter(running))
        proc, out = running.pop(name)
        done[name] = _finish(proc, out)
    return done


def _ok(run: dict) -> dict:
    assert run["rc"] == 0, run["stderr"][-2000:]
    return run


def test_only_the_planned_graphs_compile_and_the_count_is_flat(runs):
    for name in ("short", "long"):
        summary = _ok(runs[name])["summary"]
        assert summary["unexpected_graphs"] == 0, summary["unexpected"]
        assert summary["hidden_host_syncs"] == []
        assert sorted(map(tuple, summary["compiled_keys"])) == sorted(map(tuple, summary["planned_keys"]))
        assert summary["compilations"] == summary["distinct_graphs"] == summary["expected_graphs"]
        assert summary["steps"] == (SHORT if name == "short" else LONG)
    assert runs["short"]["summary"]["compilations"] == runs["long"]["summary"]["compilations"]
    # the bar reads its values once per optimizer step, a validation run a few more; Lightning alone reads the
    # progress-bar value after every micro-batch (2 per step here) before any bar draws it
    assert runs["long"]["summary"]["host_reads_per_step"] < 1.6
    assert (runs["short"]["out"] / "checkpoints").is_dir() and any((runs["short"]["out"] / "checkpoints").iterdir())


def test_plain_lightning_with_a_bare_shim_compiles_more(runs):
    """The control: the same module and loader under plain Lightning, fewer steps, compiles more graphs."""
    plain = json.loads((_ok(runs["plain"])["out"] / "plain_summary.json").read_text())
    assert plain["graphs"] > runs["long"]["summary"]["compilations"], plain


def test_losses_match_eager_cpu_lightning(runs):
    ours, eager = _ok(runs["short"])["losses"], _ok(runs["eager"])["losses"]
    assert len(ours) == len(eager) == 2 * SHORT
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, eager))
    assert worst < 1e-5, worst
    # control: the comparison sees a different data order (the losses of the next batches)
    assert max(abs(a - b) / abs(b) for a, b in zip(ours[2:], eager[:-2])) > 1e-3


def test_fail_stops_on_an_unplanned_shape_with_the_shapes_named(runs):
    run = runs["fail"]
    assert run["rc"] == 1, run["stderr"][-2000:]
    line = [x for x in run["stderr"].splitlines() if x.startswith("neurontrain: error:")]
    assert line and "not in the plan" in line[0] and "'input_ids': [8, " in line[0], run["stderr"][-2000:]
    assert "Traceback" not in run["stderr"]
    assert run["summary"]["unexpected_graphs"] == 1


def test_an_item_in_training_step_is_named_as_a_hidden_host_sync(runs):
    run = _ok(runs["item"])
    hidden = run["summary"]["hidden_host_syncs"]
    assert hidden and hidden[0]["kind"] == "train", hidden
    assert "a host sync inside the step (.item()" in run["stderr"]


def test_a_failed_preflight_exits_3_before_step_1(runs):
    run = runs["preflight"]
    assert run["rc"] == 3, run["stderr"][-2000:]
    assert "preflight failed" in run["stderr"] and "expected 4 devices per worker, found 1" in run["stderr"]
    assert run["losses"] is None and run["summary"] is None  # nothing trained
