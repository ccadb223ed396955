"""neurontrain.lightning on XLA:CPU with examples/lightning_tiny.py (an unchanged LightningModule: automatic
optimization, prog_bar logging, validation, a dynamic-padding loader, ModelCheckpoint, accumulation 2, clipping,
a per-step LR schedule): only the planned graphs, the same count on a short and a longer run, no hidden host
syncs, the losses of eager CPU Lightning; plain Lightning with a bare shim compiles more; the guard stops on an
unplanned shape and names an `.item()` in `training_step`; a failed preflight exits 3. A matrix of modules written
as Lightning's docs write them (tests/lightning_matrix.py: several fits in one process, each measured by counter
deltas) compiles only its planned graphs whatever it logs, its compile count flat from N to 2N steps, its host
reads within Lightning's logging points.

The runs are module-scoped, shared by the assertions, and run two at a time (two cores).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import standin_runtime

from neurontrain.compile.graphs import graph_id

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "lightning_tiny.py"
MATRIX = REPO / "tests" / "lightning_matrix.py"
SHORT, LONG = 20, 100  # validation every 10 steps (an epoch)
MATRIX_STEPS = 10  # N: each matrix fit runs 2N steps (the short-epoch variants N / 2)


def _start(out: Path, *args: str, extra_env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PJRT_DEVICE": "CPU", **(extra_env or {})}
    script = MATRIX if args[0] == "matrix" else EXAMPLE
    args = args[1:] if args[0] == "matrix" else args
    command = [sys.executable, str(script), "--output-dir", str(out), *args]
    if args[0] == "precompile":  # the CLI, on the example's build function with the long run's arguments
        spec = f"{EXAMPLE}:build --output-dir {out / 'fit'} {' '.join(args[1:])}"
        command = [sys.executable, "-m", "neurontrain", "precompile", "--lightning", spec, "--cache", str(out)]
        command += ["--json", str(out / "report.json")]
    elif "--dump" in args:  # torch-xla's own record of every graph the run's syncs cut
        command.remove("--dump")
        env.update(XLA_SAVE_TENSORS_FILE=str(out / "xla-graphs"), XLA_SAVE_TENSORS_FMT="hlo")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:  # polled: no pipe fills
        return subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, text=True)


def _finish(proc: subprocess.Popen, out: Path) -> dict:
    proc.wait(timeout=600)
    summary = out / "summary.json"
    return {
        "rc": proc.returncode,
        "stderr": (out / "stderr.txt").read_text(),
        "out": out,
        "summary": json.loads(summary.read_text()) if summary.is_file() else None,
        "losses": json.loads((out / "losses.json").read_text()) if (out / "losses.json").is_file() else None,
    }


RUNS = {  # name: arguments; two at a time (two cores), the next one as soon as one has ended
    "matrix": ["matrix", "--steps", str(MATRIX_STEPS)],  # tests/lightning_matrix.py: the longest, alongside the rest
    "precompile": ["precompile", "--max-steps", str(LONG)],
    "short": ["--max-steps", str(SHORT)],
    "long": ["--max-steps", str(LONG), "--dump"],  # starts once precompile has ended (its cache is then full)
    "plain": ["--max-steps", "3", "--plain"],
    "item": ["--max-steps", "1", "--item", "--no-preflight"],
    "eager": ["--max-steps", str(SHORT), "--eager"],
    "fail": ["--max-steps", "3", "--buckets", "16,32", "--recompile-guard", "fail"],
    "preflight": ["--max-steps", "2", "--expected-devices", "4"],
}
AFTER = {"long": "precompile"}  # the long run loads what precompile put in the runtime cache


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of this module, two processes at a time."""
    base = tmp_path_factory.mktemp("lightning")
    # precompile and the long run on a host with the stand-in Neuron runtime: one runtime cache, one event log
    standin, read_log = standin_runtime(base)
    standin["NEURON_COMPILE_CACHE_URL"] = str(base / "runtime-cache")
    pending, running, done = list(RUNS.items()), {}, {"runtime_log": read_log}
    deadline = time.monotonic() + 1800
    while pending or running:
        ready = [(n, a) for n, a in pending if AFTER.get(n) is None or AFTER[n] in done]
        for name, args in ready[: 2 - len(running)]:
            pending.remove((name, args))
            env = standin if name in ("precompile", "long") else None
            running[name] = (_start(base / name, *args, extra_env=env), base / name)
        ended = [name for name, (proc, _) in running.items() if proc.poll() is not None]
        for name in ended:
            done[name] = _finish(*running.pop(name))
        assert time.monotonic() < deadline, f"still running: {list(running)}"
        if not ended:
            time.sleep(0.5)
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
    assert runs["short"]["summary"]["host_reads_per_step"] < 1.6
    assert (runs["short"]["out"] / "checkpoints").is_dir() and any((runs["short"]["out"] / "checkpoints").iterdir())


def _matrix(runs) -> dict:
    return json.loads((_ok(runs["matrix"])["out"] / "matrix.json").read_text())


def test_every_module_of_the_matrix_compiles_only_its_planned_graphs_whatever_it_logs(runs):
    """The issue's module (as written, and without the sanity check), on_epoch logging, sync_dist, torchmetrics
    Accuracy, a per-step LR schedule, a Hugging Face model, a LightningDataModule, limit_val_batches, torch's
    encoder layer with bigger eval batches and odd epochs: each under recompile_guard="fail" (an unexpected graph
    ends the fit with its error). Before: the issue's module compiled `eval 64` again at step 0 and `train 64` at
    step 1 (its script imported torch_xla first), torchmetrics and on_epoch logging compiled graphs at epoch ends,
    the Hugging Face model launched a graph inside every forward. Later fits find earlier fits' shape-free graphs
    (an eval-epoch mean of the same logged names) compiled, so a fit may compile fewer than it plans, never more."""
    matrix = _matrix(runs)
    assert len(matrix) == 10
    for name, fit in matrix.items():
        summary = fit["summary"]
        assert fit["error"] is None and summary, (name, fit["error"])
        assert summary["unexpected_graphs"] == 0 and summary["hidden_host_syncs"] == [], (name, summary["unexpected"])
        assert set(map(tuple, summary["compiled_keys"])) <= set(map(tuple, summary["planned_keys"])), name
        assert summary["distinct_graphs"] <= summary["expected_graphs"], name
        assert summary["steps"] == fit["steps"] and fit["epochs"] >= 1 and fit["validation_runs"] >= 2, (name, fit)
        assert 0 < fit["at_n"] == fit["at_2n"], (name, fit)  # flat from N to 2N steps
        assert 0 < fit["at_2n"] <= summary["expected_graphs"], (name, fit)
        # the bar once per optimizer step, the means of a validation run or of an epoch once each, a logger's
        # logging point once: never once per logged key per step
        points = fit["steps"] + fit["validation_runs"] + fit["epochs"] + fit["log_points"]
        assert summary["host_reads"] <= points + 4, (name, summary["host_reads"], points)
    # the train-epoch means are a graph of their own, planned once the first batch logged on_epoch values
    assert ["train-epoch"] in matrix["on_epoch"]["summary"]["compiled_keys"]
    assert ["train-epoch"] not in matrix["issue"]["summary"]["planned_keys"]


def test_a_torch_encoder_layer_with_bigger_eval_batches_and_odd_epochs_compiles_only_its_plan(runs):
    """The sanity check's second validation batch has fewer rows than its first (padded to its loader's batch
    size, not the training loader's), and each epoch ends with an optimizer step after one micro-batch (its
    gradients in accumulation's form): before both, 8 compilations for 6 planned graphs."""
    fit = _matrix(runs)["encoder"]
    summary = fit["summary"]
    assert summary["unexpected_graphs"] == 0, summary["unexpected"]
    planned, compiled = (set(map(tuple, summary[k])) for k in ("planned_keys", "compiled_keys"))
    assert summary["expected_graphs"] == 6 and fit["at_n"] == fit["at_2n"]
    # an earlier fit of the process compiled the same eval-epoch mean (val_loss); every other key compiled here
    assert planned - {("eval-epoch",)} <= compiled <= planned
    assert fit["epochs"] >= 3  # 5 micro-batches an epoch, accumulation 2


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


def _dumped_graphs(out: Path) -> dict[str, set[str]]:
    """torch-xla's graph hash -> our graph ids of every HLO module dumped under it, from the run's dump (a block
    per sync: the module, then torch-xla's graph hash)."""
    found: dict[str, set[str]] = {}
    for f in out.glob("xla-graphs*"):
        for block in re.findall(r"## BEGIN_GRAPH\n(.*?)\n## END_GRAPH", f.read_text(), re.S):
            hlo, xla_hash = block.split("\n\nGraph Hash:")
            found.setdefault(xla_hash.strip(), set()).add(graph_id(hlo))
    return found


def test_precompile_records_every_graph_a_100_step_run_compiles_and_the_run_loads_them_all(runs):
    """Through the stand-in Neuron runtime (tests/standin/runtime: modules keyed by what XLA compiled and a salt
    secret to the run), so only modules the runtime itself extracted in precompile can be hits in the run."""
    pre, long = _ok(runs["precompile"]), _ok(runs["long"])
    report = json.loads((pre["out"] / "report.json").read_text())
    manifest = json.loads(Path(report["manifest"]).read_text())
    recorded = {g["graph_id"] for g in manifest["graphs"]}
    dumped = _dumped_graphs(long["out"])
    assert dumped and report["failed"] == 0 and report["target"] == "neuron"
    # every sync of a graph hash handed torch-xla the same module: which bucket came first cannot change it
    assert all(len(ids) == 1 for ids in dumped.values()), dumped
    compiled = set().union(*dumped.values())
    assert len(compiled) == long["summary"]["compilations"] + 3  # and the preflight's three device checks
    assert compiled <= recorded, compiled - recorded
    keys = {tuple(g["key"]) for g in manifest["graphs"] if g["key"][0] != "other"}
    assert keys == set(map(tuple, long["summary"]["planned_keys"]))
    cache_root = Path(report["manifest"]).parents[1]  # the runtime's cache: where the script's runs look
    for g in manifest["graphs"]:
        assert (cache_root / g["hlo_file"]).stat().st_size == g["hlo_bytes"] > 0
    assert not (pre["out"] / "fit" / "checkpoints").exists()  # the precompile fit keeps the user's dirs clean

    events = runs["runtime_log"]()
    extracted = {e["module"] for e in events if e["event"] == "extract"}
    assert {m for g in manifest["graphs"] for m in g["modules"]} == extracted
    assert report["compiled"] == len(extracted) > 0
    assert [e for e in events if e["event"] == "miss"] == []  # extraction compiled nothing; the run missed nothing
    assert {e["module"] for e in events if e["event"] == "hit"} == extracted
