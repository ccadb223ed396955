"""The native backend (torch.compile with inductor on the CPU), with torch_xla unimportable: both tiny recipes
train with only their planned graphs and match the eager reference; the guard reports what TorchDynamo
compiled outside the plan, with TorchDynamo's reason.

Each recipe runs once on native and once on eager (module-scoped), with its own empty inductor cache: the
compiles are cold, whatever an earlier run left in the default cache.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import RECIPES, read_json, read_metrics, run_cli
from safetensors.torch import load_file
from torch_xla_blocker import without_torch_xla

from neurontrain.backends import select_backend
from neurontrain.errors import RecompilationError
from neurontrain.loop.guard import RecompilationGuard

pytestmark = pytest.mark.slow

# steps a recipe needs for its loss to fall by 30% (the tiny Llama: 0.63 of the start at 25; BERT's loss holds
# near ln 2 for 25 steps and falls after)
STEPS = {"tiny-llama-clm": 25, "tiny-bert-classification": 50}
NO_DROPOUT = {
    "tiny-bert-classification": [
        "model.config.hidden_dropout_prob=0.0",
        "model.config.attention_probs_dropout_prob=0.0",
    ],
    "tiny-llama-clm": ["model.config.attention_dropout=0.0"],
}


@pytest.fixture(scope="module")
def no_torch_xla(tmp_path_factory) -> dict:
    """Environment for a process in which torch_xla cannot be imported; its log records the blocker at work."""
    return without_torch_xla(tmp_path_factory.mktemp("no-torch-xla"))


@pytest.fixture(scope="module", params=sorted(NO_DROPOUT))
def runs(request, tmp_path_factory, no_torch_xla) -> dict:
    """One recipe, STEPS in fp32 without dropout, on native and on eager (torch_xla blocked in both)."""
    recipe = request.param
    root = tmp_path_factory.mktemp(recipe)
    common = [str(RECIPES / f"{recipe}.yaml")]
    for item in [f"train.max_steps={STEPS[recipe]}", "train.log_every=1", "checkpoint.every=0", "train.precision=fp32"]:
        common += ["--set", item]
    for item in NO_DROPOUT[recipe]:
        common += ["--set", item]
    out = {"recipe": recipe, "steps": STEPS[recipe]}
    # eager too runs without torch_xla, with a log of its own: transformers looks for torch_xla on eager
    for backend, env in (("native", no_torch_xla), ("eager", without_torch_xla(root / "eager-no-torch-xla"))):
        env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-cache")}
        result = run_cli("run", *common, "--backend", backend, "--output-dir", str(root / backend), env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        out[backend] = root / backend
    return out


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def test_native_trains_with_the_planned_graphs_only(runs):
    summary = read_json(runs["native"] / "summary.json")
    assert summary["backend"] == "native"
    assert summary["unexpected_graphs"] == 0, summary["unexpected"]
    # one graph per train length and per eval length (forward and backward are one TorchDynamo graph)
    planned = len(summary["buckets_used"]) * 2
    assert summary["compilations"] == summary["distinct_graphs"] == summary["expected_graphs"] == planned
    assert summary["compile_seconds"] > 0
    losses, steps = _losses(runs["native"]), runs["steps"]
    first, last = sum(losses[s] for s in (1, 2)) / 2, sum(losses[s] for s in (steps - 1, steps)) / 2
    assert last < 0.7 * first, (first, last)
    assert summary["eval_loss"] < summary["first_loss"]
    # compiled in place: the exported weights carry the model's own names, as on the other backends
    native = load_file(str(runs["native"] / "model" / "model.safetensors"))
    eager = load_file(str(runs["eager"] / "model" / "model.safetensors"))
    assert sorted(native) == sorted(eager)


def test_native_matches_eager_at_every_step(runs):
    native, eager = _losses(runs["native"]), _losses(runs["eager"])
    assert sorted(native) == list(range(1, runs["steps"] + 1)) == sorted(eager)
    worst = max(abs(native[s] - eager[s]) / abs(eager[s]) for s in native)
    print(f"{runs['recipe']}: native vs eager, largest relative loss difference {worst:.2e}")
    assert worst < 1e-4, worst


def test_the_native_runs_had_no_torch_xla(runs, no_torch_xla, tmp_path):
    """The blocker was loaded in the runs' processes, which never even looked for torch_xla; and it works."""
    log = Path(no_torch_xla["NO_TORCH_XLA_LOG"]).read_text()
    assert "active in" in log and "refused" not in log, log
    probe_log = tmp_path / "probe.log"
    probe = subprocess.run(
        [sys.executable, "-c", "import torch_xla"],
        env={**os.environ, **no_torch_xla, "NO_TORCH_XLA_LOG": str(probe_log)},
        capture_output=True,
        text=True,
    )
    assert probe.returncode != 0 and "No module named 'torch_xla'" in probe.stderr
    assert "refused torch_xla" in probe_log.read_text()


class _Head(torch.nn.Module):
    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.proj, self.graph_break = torch.nn.Linear(4, 4), graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x).relu()
        if self.graph_break:
            torch._dynamo.graph_break()
        return y.sum()


def _guarded(monkeypatch, model: torch.nn.Module, mode: str) -> tuple[RecompilationGuard, list[str]]:
    monkeypatch.setenv("USE_TORCH_XLA", "0")  # select_backend sets it for transformers; keep it to this test
    backend = select_backend("native")
    backend.compile_model(model, planned_graphs=1)
    reports: list[str] = []
    guard = RecompilationGuard(
        [("train", 8)],
        mode,
        backend.compile_count,
        backend.execute_count,
        reports.append,
        explain=backend.compile_notes,
    )
    return guard, reports


def test_the_guard_reports_a_length_the_plan_did_not_list(monkeypatch):
    model = _Head()
    guard, reports = _guarded(monkeypatch, model, "warn")
    for step, length in enumerate((8, 8, 16, 8), start=1):
        model(torch.randn(2, length, 4))
        guard.after_sync(("train", length), step, {"x": [2, length, 4]})
    assert guard.compiled == {("train", 8): 1, ("train", 16): 1}
    [event] = guard.unexpected
    assert (event["key"], event["reason"], event["step"]) == (["train", 16], "not in the plan", 3)
    assert any("size mismatch" in why and "expected 8, actual 16" in why for why in event["why"]), event
    assert len(reports) == 1 and "not in the plan" in reports[0] and "recompiled:" in reports[0]


def test_the_guard_stops_on_a_graph_break_in_fail_mode(monkeypatch):
    model = _Head(graph_break=True)
    guard, _ = _guarded(monkeypatch, model, "fail")
    model(torch.randn(2, 8, 4))
    with pytest.raises(RecompilationError, match="more graphs than syncs.*graph break"):
        guard.after_sync(("train", 8), 1, {"x": [2, 8, 4]})


def test_a_cpu_without_a_cpp_compiler_is_one_line_and_exit_2(tmp_path):
    result = run_cli(
        "run",
        str(RECIPES / "tiny-llama-clm.yaml"),
        "--backend",
        "native",
        "--set",
        "train.max_steps=1",
        "--set",
        "train.schedule.warmup_steps=0",
        "--output-dir",
        str(tmp_path / "run"),
        env={"CXX": str(tmp_path / "no-such-c++")},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "inductor found no C++ compiler" in result.stderr and "Traceback" not in result.stderr
