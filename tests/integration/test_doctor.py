"""`neurontrain doctor` on XLA:CPU against the stand-in Neuron runtime (tests/standin/runtime: module keys salted
per test, from XLA's own module dumps) and the NxD stand-in: `--quick` once, every check passing; then each check
alone, on the quick run's kept artifacts, failing with its own line under a fault the stand-ins inject. The quick
run's precompiles and runs are also where the Llama family's "precompile, then every run graph is a cache hit" is
checked against the runtime's own log (the BERT family's: test_neuron_runtime.py)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, read_json, run_cli, standin_runtime

from neurontrain.checkpoint.migrate import MigrateOptions, migrate
from neurontrain.compile.runtime_compile import default_compile_workers, host_memory_bytes
from neurontrain.doctor.checks import CHECKS
from neurontrain.doctor.context import DoctorContext, scratch_environment
from neurontrain.doctor.report import passed
from neurontrain.doctor.runner import run_check

pytestmark = pytest.mark.slow

SECRET = "doctor-test-secret-value"
BY_NAME = {c.name: c for c in CHECKS}


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("doctor")
    env, read_log = standin_runtime(root)
    nxd = str(REPO / "tests" / "standin" / "nxd")
    env.update(
        PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], nxd]),
        NEURON_CC_FLAGS="--retry_failed_compilation -O1",  # a wrapper option and a compiler flag
        NEURON_PLATFORM_TARGET_OVERRIDE="trn1",  # the target known: the predicted flags hash is checked too
        AWS_SECRET_ACCESS_KEY=SECRET,
    )
    kept, report = root / "kept", root / "report.json"
    result = run_cli("doctor", "--quick", "--keep", str(kept), "--json", str(report), env=env, timeout=1800)
    return {"root": root, "env": env, "kept": kept, "result": result, "report": read_json(report), "read_log": read_log}


def test_quick_passes_every_check_and_reports_without_secrets(quick):
    result, report = quick["result"], quick["report"]
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["environment", "compile-once", "collectives", "data-parallel", "checkpoint"]
    assert {c["status"] for c in checks.values()} == {"pass"}, result.stdout
    print(f"doctor --quick: {report['seconds']} s; " + ", ".join(f"{n} {c['seconds']} s" for n, c in checks.items()))
    assert report["schema"] == "neurontrain-doctor" and report["schema_version"] == 1
    assert SECRET not in json.dumps(report) and "AWS_SECRET_ACCESS_KEY" not in report["environment"]
    assert report["environment"]["NEURON_CC_FLAGS"] == "--retry_failed_compilation -O1"
    compiler = checks["environment"]["figures"]["compiler"]
    assert compiler["compiler_flags"] == ["--target=trn1", "-O1"]  # what the runtime wrote (checked in compile-once)
    compiled = checks["compile-once"]["figures"]
    assert compiled["one worker"]["flags_hash"] == [compiler["compiler_flags_hash"]]
    for part in ("one worker", "2 workers"):
        assert compiled[part]["compiled_at_run_time"] == 0 and compiled[part]["modules_new_at_run"] == 0
        assert compiled[part]["cache_hits"] > 0
    assert compiled["extraction run"] == {"files_published": 0, "modules_compiled": 0}
    assert checks["data-parallel"]["figures"]["worst_relative_loss_difference"] <= 1e-5
    assert checks["checkpoint"]["figures"]["weights_bit_identical"] is True


def _events(quick, named: Path, kind: str) -> list[dict]:
    """The stand-in runtime's `kind` events in the doctor's processes whose command line names `named`."""
    return [e for e in quick["read_log"]() if e["event"] == kind and str(named) in e["argv"]]


def _manifest_modules(report: dict) -> set[str]:
    graphs = read_json(report["manifest"])["graphs"]
    assert graphs and all(g["modules"] for g in graphs)
    return {m for g in graphs for m in g["modules"]}


def test_precompiled_modules_are_what_the_runtime_named_and_every_run_loads_them(quick):
    """The compile-once check's runs, seen from the runtime's side: precompile's manifest names exactly the
    modules the runtime extracted, its parallel compile (pool size not given: one compiler per 64 GiB of this
    host) compiled each one, and the runs then load every one from the cache, both workers of the 2-worker run
    (its own plan, micro-step + optimizer graphs, precompiled at that world size): no module compiled at run time."""
    kept = quick["kept"]
    report = read_json(kept / "precompile-1.json")
    named = _manifest_modules(report)
    assert {e["module"] for e in _events(quick, kept / "precompile-1.json", "extract")} == named
    assert _events(quick, kept / "precompile-1.json", "miss") == []  # the runtime created no other directory
    assert report["failed"] == 0 and report["compiled"] == len(named)
    assert all({"model.neff", "model.done"} <= {p.name for p in (kept / "cache" / m).iterdir()} for m in named)
    compiles = [e for e in quick["read_log"]() if e["event"] == "parallel_compile"]
    assert [e["num_parallel"] for e in compiles] == [default_compile_workers(host_memory_bytes())] * 2

    assert _events(quick, kept / "run-1", "miss") == []
    assert {e["module"] for e in _events(quick, kept / "run-1", "hit")} == named
    summary = read_json(kept / "run-1" / "summary.json")
    assert summary["neuron_cache"]["compiled_at_run_time"] == 0
    assert summary["neuron_cache"]["cache_hits"] == summary["compilations"] > 0

    two = _manifest_modules(read_json(kept / "precompile-2.json"))
    assert _events(quick, kept / "run-2", "miss") == []
    hits = _events(quick, kept / "run-2", "hit")
    assert {e["module"] for e in hits} <= two
    assert len({e["pid"] for e in hits}) >= 2  # both workers loaded from the cache
    assert read_json(kept / "run-2" / "summary.json")["neuron_cache"]["compiled_at_run_time"] == 0


def _context(quick, tmp_path, fault: str | None, nproc: int = 2) -> DoctorContext:
    """A doctor context on a copy of the quick run's cache, its precompiles and extraction run already done."""
    env = {**os.environ, **quick["env"], **({"STANDIN_FAULT": fault} if fault else {})}
    ctx = DoctorContext(tmp_path / "doctor", nproc=nproc, env=scratch_environment(env))
    shutil.copytree(quick["kept"] / "cache", ctx.cache)
    for workers in (1, 2):
        manifest = read_json(read_json(quick["kept"] / f"precompile-{workers}.json")["manifest"])
        ctx.seed(f"precompile-{workers}", sorted({m for g in manifest["graphs"] for m in g["modules"]}))
    ctx.seed("extract", passed())
    return ctx


def _fails(check: str, ctx: DoctorContext) -> str:
    result = run_check(BY_NAME[check], ctx)
    assert result.status == "fail", result
    assert result.docs == f"docs/doctor.md#{check}"
    return result.message


@pytest.mark.parametrize(
    "fault, line",
    [
        ("rename-at-run", "its module names differ between extraction and execution"),
        ("flags-at-run", "the runtime got other compiler flags at run time than at precompile"),
    ],
)
def test_compile_once_fails_when_the_runtime_changes_its_mind(quick, tmp_path, fault, line):
    message = _fails("compile-once", _context(quick, tmp_path, fault, nproc=1))
    assert message.startswith("one worker: ") and line in message
    if fault == "flags-at-run":
        assert "(the run adds --model-type=transformer)" in message


def test_data_parallel_fails_when_a_worker_returns_wrong_data(quick, tmp_path):
    ctx = _context(quick, tmp_path, "wrong-data")
    ctx.seed("run-1", quick["kept"] / "run-1")
    message = _fails("data-parallel", ctx)
    assert message.startswith("2 workers vs 1 on the same global batch: loss differs by")


def test_checkpoint_fails_when_the_resume_differs(quick, tmp_path):
    """The checkpoint the run resumes from does not hold the state it had (its weights moved by 1e-4)."""
    ctx = _context(quick, tmp_path, None)
    ctx.seed("run-1", quick["kept"] / "run-1")
    out = tmp_path / "killed"
    step = out / "checkpoints" / "step_00000002"
    shutil.copytree(quick["kept"] / "run-1" / "checkpoints" / "step_00000002", step)
    state = torch.load(step / "state.pt", weights_only=False)
    for tensor in state["model"].values():
        tensor.add_(1e-4)
    torch.save(state, step / "state.pt")
    ctx.seed("killed", (out, 2, True))
    assert "the checkpoint does not restore the whole state" in _fails("checkpoint", ctx)


def _shards_of(model: Path, root: Path) -> Path:
    """An NxD TP 2 checkpoint of `model`, laid out as the TP run's checkpoints directory (step 6, complete)."""
    step = root / "checkpoints" / "step_00000006"
    migrate(model, step, MigrateOptions(to="neuron", tp=2))
    (step / "COMPLETE").touch()
    return root


def test_tensor_parallel_merge_passes_and_fails_on_a_shard_that_does_not_merge_back(quick, tmp_path):
    """The check's merge half (migrate to Hugging Face, `verify --logits` against the unsharded run) on TP 2
    shards of the unsharded run's own weights: equal; with one rank's o_proj shard in another column order, not."""
    run1 = quick["kept"] / "run-1"
    good = _shards_of(run1 / "model", tmp_path / "good")
    shutil.copy(run1 / "metrics.jsonl", good / "metrics.jsonl")  # the TP run "trained alike": losses the same
    ctx = _context(quick, tmp_path / "a", None)
    ctx.seed("tensor-parallel", (run1, good))
    assert run_check(BY_NAME["tensor-parallel"], ctx).status == "pass"

    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    rank1 = next((bad / "checkpoints" / "step_00000006").rglob("dp_rank_00_tp_rank_01_pp_rank_00.pt"))
    shard = torch.load(rank1)
    name = next(k for k in shard if k.endswith("layers.0.self_attn.o_proj.weight"))
    shard[name] = shard[name].flip(1).contiguous()
    torch.save(shard, rank1)
    ctx = _context(quick, tmp_path / "b", None)
    ctx.seed("tensor-parallel", (run1, bad))
    assert "the shards do not merge back" in _fails("tensor-parallel", ctx)
