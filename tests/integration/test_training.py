"""Real training through torch-xla on XLA:CPU, each run in its own process."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import RECIPES, REPO, read_json, read_metrics, run_cli, start_cli
from safetensors.torch import load_file

from neurontrain.recipe import load_recipe

pytestmark = pytest.mark.slow


LOG_EVERY = {"tiny-bert-classification": 10, "tiny-llama-clm": 5}  # as the recipes set train.log_every


def _recipe_run(out: Path, recipe: str, *args: str) -> subprocess.CompletedProcess:
    result = run_cli("run", str(RECIPES / f"{recipe}.yaml"), "--output-dir", str(out), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def llama_recipe_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The shipped tiny-Llama recipe as it is, logging every step: the recipe's own run and the XLA side of the
    comparison with eager (its defaults are that comparison's settings: fp32, no attention dropout)."""
    out = tmp_path_factory.mktemp("llama-recipe") / "xla-cpu"
    return out, _recipe_run(out, "tiny-llama-clm", "--set", "train.log_every=1")


@pytest.mark.parametrize("recipe", ["tiny-bert-classification", "tiny-llama-clm"])
def test_tiny_recipe_trains_without_unexpected_graphs(tmp_path: Path, recipe: str, request):
    if recipe == "tiny-llama-clm":
        out, result = request.getfixturevalue("llama_recipe_run")
    else:
        out = tmp_path / "run"
        result = _recipe_run(out, recipe)
    summary = read_json(out / "summary.json")
    for key in (
        "backend",
        "steps",
        "first_loss",
        "final_loss",
        "compilations",
        "distinct_graphs",
        "unexpected_graphs",
        "tokens_per_second",
        "padding_fraction",
        "wall_seconds",
    ):
        assert key in summary, key
    assert summary["backend"] == "xla-cpu"
    # stdout holds the result line alone: no library's warning (DeepSpeed's accelerator pick, where it is
    # installed, loaded by save_pretrained) among it or on stderr
    assert json.loads(result.stdout)["steps"] == summary["steps"]
    assert "Setting accelerator" not in result.stdout + result.stderr
    assert summary["unexpected_graphs"] == 0, summary["unexpected"]
    assert summary["hidden_host_syncs"] == []
    # as shipped, the tiny recipes pack (data.packing: auto): rows of about data.batch_size samples, under 5 % padding
    shipped = load_recipe(RECIPES / f"{recipe}.yaml")
    assert summary["bucket_mode"] == "packed" and summary["padding_fraction"] < 0.05, summary["padding_fraction"]
    assert summary["per_worker_batch"] <= shipped.data.batch_size and summary["grad_accum"] == shipped.train.grad_accum
    assert summary["effective_batch"] == summary["per_worker_batch"] * shipped.train.grad_accum
    step_kinds = 2  # train, eval
    assert summary["compilations"] <= len(summary["buckets_used"]) * step_kinds + 2
    records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    for key in ("step", "loss", "lr", "tokens_per_second", "compilations"):
        assert key in records[0]
    records = [r for r in records if r["step"] % LOG_EVERY[recipe] == 0]  # the steps the recipe itself logs
    first = sum(r["loss"] for r in records[:2]) / 2
    last = sum(r["loss"] for r in records[-2:]) / 2
    assert last < 0.7 * first, (first, last)
    assert summary["eval_loss"] < summary["first_loss"]
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "config.json").is_file()
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints[-1].startswith("step_") and len(checkpoints) <= 2
    assert list((out / "tensorboard").iterdir())


NO_DROPOUT = [
    "--set",
    "model.config.hidden_dropout_prob=0.0",
    "--set",
    "model.config.attention_probs_dropout_prob=0.0",
]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def _assert_xla_matches_eager(xla: Path, eager: Path, steps: int) -> None:
    a, b = _losses(xla), _losses(eager)
    assert sorted(a) == list(range(1, steps + 1)) == sorted(b)
    worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in range(1, steps + 1))
    assert worst < 1e-4, worst


def test_xla_matches_eager_reference_bert(tmp_path: Path):
    common = ["--set", "train.max_steps=50", "--set", "train.log_every=1", "--set", "checkpoint.every=0"]
    common += ["--set", "checkpoint.save_final=false", "--set", "train.precision=fp32", *NO_DROPOUT]
    common += ["--set", "train.eval_at_end=false"]  # the training losses are compared: no evaluation graphs
    common += ["--no-preflight"]  # nor the preflight's device-check graphs
    for backend in ("xla-cpu", "eager"):
        _recipe_run(tmp_path / backend, "tiny-bert-classification", *common, "--backend", backend)
    _assert_xla_matches_eager(tmp_path / "xla-cpu", tmp_path / "eager", 50)


def test_xla_matches_eager_reference_llama(tmp_path: Path, llama_recipe_run):
    """The recipe's run on XLA:CPU against the same recipe on eager CPU, every one of its 60 steps."""
    xla, _ = llama_recipe_run
    _recipe_run(tmp_path / "eager", "tiny-llama-clm", "--set", "train.log_every=1", "--backend", "eager")
    _assert_xla_matches_eager(xla, tmp_path / "eager", 60)


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model" / "model.safetensors")), load_file(str(b / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key].dtype == wb[key].dtype
        assert wa[key].view(-1).view(dtype=torch.uint8).equal(wb[key].view(-1).view(dtype=torch.uint8)), key


RESUME_ARGS = [
    str(RECIPES / "tiny-bert-classification.yaml"),
    "--set",
    "train.max_steps=20",
    "--set",
    "checkpoint.every=5",
    "--set",
    "checkpoint.keep=2",
    "--set",
    "train.log_every=1",
    "--set",
    "train.eval_at_end=false",  # the weights are compared: an evaluation would only add its graphs to each run
    "--no-preflight",  # nor the preflight's device checks: the resumed training is what is compared
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    result = run_cli("run", *RESUME_ARGS, "--output-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_sigkill_mid_run_then_resume_is_bit_identical(tmp_path: Path, uninterrupted: Path):
    out = tmp_path / "killed"
    proc = start_cli("run", *RESUME_ARGS, "--output-dir", str(out))
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            if metrics.exists() and any(r.get("step", 0) >= 12 for r in read_metrics(metrics)):
                break
            assert proc.poll() is None, "run ended before it could be killed"
            time.sleep(0.05)
        proc.kill()
    finally:
        proc.communicate()
    assert not (out / "summary.json").exists()
    result = run_cli("run", *RESUME_ARGS, "--output-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["resumed_from_step"] in (10, 15)
    assert summary["data"]["tokenized_documents"] == 0  # the uninterrupted run's tokenized store, mapped again
    _same_weights(out, uninterrupted)
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 20


KILL_DURING_CHECKPOINT_WRITE = """
import os, signal, sys
import neurontrain.loop.checkpoints as training
real_fsync = training.fsync_path
def fsync_then_die(path):
    real_fsync(path)
    if path.name == "state.pt" and path.parent.name == ".step_00000010.partial":
        os.kill(os.getpid(), signal.SIGKILL)   # state written, marker not yet: a torn checkpoint
training.fsync_path = fsync_then_die
from neurontrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_during_checkpoint_write_then_resume_is_bit_identical(tmp_path: Path, uninterrupted: Path):
    out = tmp_path / "torn"
    result = subprocess.run(
        [sys.executable, "-c", KILL_DURING_CHECKPOINT_WRITE, "run", *RESUME_ARGS, "--output-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert (out / "checkpoints" / ".step_00000010.partial" / "state.pt").exists()
    assert [p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")] == ["step_00000005"]
    result = run_cli("run", *RESUME_ARGS, "--output-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_json(out / "summary.json")["resumed_from_step"] == 5
    assert not (out / "checkpoints" / ".step_00000010.partial").exists()
    _same_weights(out, uninterrupted)


def test_recompile_guard_fail_mode_names_the_shapes(tmp_path: Path):
    """A recipe whose plan is wrong on purpose: buckets are dynamic but the guard must still attribute
    compiles; with fail mode a recompilation of an already compiled key stops the run (exit 1)."""
    result = run_cli(
        "run",
        str(RECIPES / "tiny-llama-clm.yaml"),
        "--output-dir",
        str(tmp_path / "g"),
        "--set",
        "train.max_steps=4",
        "--set",
        "data.buckets=dynamic",
        "--set",
        "data.packing=off",  # dynamic padding itself, not the rows packing would choose
        "--set",
        "data.eval_samples=8",  # one evaluation batch: one evaluation graph at its own length
        "--set",
        "train.log_every=1",
        "--set",
        "train.schedule.warmup_steps=0",
        "--set",
        "train.schedule.kind=constant",
        "--set",
        "checkpoint.every=0",
        "--no-preflight",  # the training graphs are counted: not the preflight's device checks
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(tmp_path / "g" / "summary.json")
    # dynamic padding: one graph per distinct batch length, all of them planned, none unexpected
    assert summary["unexpected_graphs"] == 0
    assert len(summary["buckets_used"]) >= 2  # several lengths: several train graphs to attribute
    assert summary["compilations"] >= len(summary["buckets_used"]) + 1


LOOP_VARIANTS = ["train.grad_accum=2", "train.precision=bf16", "data.last_batch=pad"]


def test_loop_variants_keep_one_graph_per_step_kind(tmp_path: Path):
    """Gradient accumulation, bf16 and a padded last batch together, in one run: none of them may add a graph
    beyond one per bucket and step kind (plus accumulation's shared optimizer-step graph)."""
    args = [
        "run",
        str(RECIPES / "tiny-llama-clm.yaml"),
        "--output-dir",
        str(tmp_path / "v"),
        "--set",
        "train.max_steps=12",
        "--set",
        "checkpoint.every=0",
        "--set",
        "train.schedule.warmup_steps=2",
        "--set",
        "train.recompile_guard=fail",
        "--no-preflight",  # the training graphs are counted: not the preflight's device checks
    ]
    for item in LOOP_VARIANTS:
        args += ["--set", item]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(tmp_path / "v" / "summary.json")
    assert summary["unexpected_graphs"] == 0 and summary["hidden_host_syncs"] == []
    extra = 1  # the shared optimizer-step graph of train.grad_accum=2
    assert summary["compilations"] <= len(summary["buckets_used"]) * 2 + 1 + extra
    assert summary["final_loss"] < summary["first_loss"]
