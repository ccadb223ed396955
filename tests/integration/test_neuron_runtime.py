"""Precompile through the Neuron runtime, checked against the stand-in runtime (tests/standin/runtime): it keys
modules by the module XLA really compiled and a salt secret to each test, so only modules the runtime itself
named and wrote can be hits."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, read_json, run_cli

from neurontrain.compile.runtime_compile import default_compile_workers, host_memory_bytes

pytestmark = pytest.mark.slow

SHORT = ["--set", "train.max_steps=4", "--set", "train.log_every=2", "--set", "train.schedule.warmup_steps=1"]
# where what is checked is not which graphs a run has, one graph fewer to trace and compile: no eval graph
NO_EVAL = [*SHORT, "--set", "train.eval_at_end=false"]


def _events(read_log, kind):
    return [e for e in read_log() if e["event"] == kind]


def _modules(cache: Path) -> dict[str, set]:
    out = {}
    for d in cache.glob("neuronxcc-*/MODULE_*"):
        out[f"{d.parent.name}/{d.name}"] = {p.name for p in d.iterdir()}
    return out


def _precompile(args, env, tmp_path, name, *extra):
    res = run_cli("precompile", *args, "--json", str(tmp_path / f"{name}.json"), *extra, env=env)
    assert res.returncode == 0, res.stderr
    return read_json(tmp_path / f"{name}.json")


def test_after_precompile_every_run_graph_is_a_cache_hit(tmp_path, recipes, neuron_runtime):
    """The BERT family, with the preflight's device-check graphs; the Llama family's one- and two-worker runs
    (the doctor's recipe) are checked the same way in test_doctor.py, on `neurontrain doctor --quick`'s runs."""
    env, read_log = neuron_runtime
    recipe = "tiny-bert-classification"
    cache = tmp_path / "cache"
    args = [str(recipes / f"{recipe}.yaml"), "--set", f"runtime.compile_cache={cache}", *SHORT]
    report = _precompile(args, env, tmp_path, "one")
    manifest = read_json(report["manifest"])
    named = {m for g in manifest["graphs"] for m in g["modules"]}
    # the manifest names exactly the directories the runtime created, each compiled by its parallel compile phase
    assert named == {e["module"] for e in _events(read_log, "extract")}
    assert set(_modules(cache)) == named
    assert all({"model.neff", "model.done"} <= files for files in _modules(cache).values())
    assert report["failed"] == 0 and report["compiled"] == len(named)
    assert all(g["modules"] for g in manifest["graphs"])
    # no --workers: the compile pool's size is passed, one per 64 GiB of this host's memory
    assert [e["num_parallel"] for e in _events(read_log, "parallel_compile")] == [
        default_compile_workers(host_memory_bytes())
    ]

    start = len(read_log())
    run = run_cli("run", *args, "--output-dir", str(tmp_path / "run1"), env=env)
    assert run.returncode == 0, run.stderr
    seen = read_log()[start:]
    assert [e for e in seen if e["event"] == "miss"] == []
    assert {e["module"] for e in seen if e["event"] == "hit"} == named
    summary = read_json(tmp_path / "run1" / "summary.json")
    assert summary["neuron_cache"]["compiled_at_run_time"] == 0
    assert summary["neuron_cache"]["cache_hits"] == summary["compilations"] > 0


def test_cache_dir_flag_relocates_everything_and_the_target_follows_the_host(tmp_path, recipes, neuron_runtime):
    env, read_log = neuron_runtime
    flagged, recipe_cache, argv_log = tmp_path / "flagged", tmp_path / "recipe-cache", tmp_path / "argv.jsonl"
    env = {
        **env,
        "NEURON_CC_FLAGS": f"--cache_dir={flagged} --retry_failed_compilation --log_level=INFO",
        "STANDIN_INSTANCE_TYPE": "trn2.48xlarge",
        "STANDIN_CC_ARGV_LOG": str(argv_log),
    }
    args = [
        str(recipes / "tiny-llama-clm.yaml"),
        "--set",
        f"runtime.compile_cache={recipe_cache}",
        *NO_EVAL,
        "--set",
        "runtime.preflight=false",
        "--set",
        "runtime.compiler_flags=[--model-type=transformer]",
    ]
    report = _precompile(args, env, tmp_path, "pre")
    assert Path(report["manifest"]).is_relative_to(flagged)
    assert not recipe_cache.exists() or not any(recipe_cache.rglob("*"))
    assert len(_modules(flagged)) == report["compiled"] > 0
    lines = [json.loads(line) for line in argv_log.read_text().splitlines()]
    assert len(lines) == report["compiled"]
    for argv in lines:
        assert "--target=trn2" in argv and "--model-type=transformer" in argv
        assert not any(a.startswith(("--cache_dir", "--retry_failed_compilation", "--log_level")) for a in argv)
    for d in flagged.glob("neuronxcc-*/MODULE_*"):
        assert json.loads((d / "compile_flags.json").read_text())[0] == "--target=trn2"

    # the recipe can set the target; the same graphs for another target are other modules
    argv_log.unlink()
    report = _precompile(args + ["--set", "runtime.neuron_target=trn1"], env, tmp_path, "trn1")
    assert all("--target=trn1" in json.loads(line) for line in argv_log.read_text().splitlines())
    assert len(_modules(flagged)) == 2 * report["compiled"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return state not in ("Z", "X")


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return [p for p in pids if _alive(p)]


def test_sigkill_mid_compile_leaves_no_compiler_and_no_poisoned_entry(tmp_path, recipes, neuron_runtime):
    env, _ = neuron_runtime
    cache, cc_log = tmp_path / "cache", tmp_path / "cc.log"
    args = [
        str(recipes / "tiny-llama-clm.yaml"),
        "--set",
        f"runtime.compile_cache={cache}",
        *NO_EVAL,
        "--set",
        "runtime.preflight=false",
    ]
    slow = {**os.environ, "PYTHONUNBUFFERED": "1", **env, "STANDIN_CC_SECONDS": "120", "STANDIN_CC_LOG": str(cc_log)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "neurontrain", "precompile", *args],
        cwd=REPO,
        env=slow,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while not (cc_log.exists() and cc_log.read_text().strip()):
        assert proc.poll() is None and time.time() < deadline, "the compile never started"
        time.sleep(0.5)
    compilers = [int(line.split()[1]) for line in cc_log.read_text().splitlines()]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while (any(_alive(p) for p in compilers) or _processes_mentioning(str(cache))) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in compilers), "a compiler outlived precompile"
    assert _processes_mentioning(str(cache)) == [], "a compile process outlived precompile"
    assert not list(cache.glob("neuronxcc-*/MODULE_*/model.log"))

    rerun = run_cli("precompile", *args, "--json", str(tmp_path / "again.json"), env=env)
    assert rerun.returncode == 0, rerun.stderr
    again = read_json(tmp_path / "again.json")
    assert again["failed"] == 0 and again["compiled"] + again["already_cached"] >= 1
    assert all(g["status"] in ("compiled", "cached") for g in again["graphs"])


def test_extraction_run_keeps_nothing(tmp_path, recipes, neuron_runtime):
    env, read_log = neuron_runtime
    out = tmp_path / "run"
    args = [
        str(recipes / "tiny-llama-clm.yaml"),
        "--set",
        f"runtime.compile_cache={tmp_path / 'cache'}",
        *NO_EVAL,
        "--set",
        "checkpoint.every=2",
        "--set",
        "runtime.preflight=false",
    ]
    run = run_cli("run", *args, "--output-dir", str(out), env={**env, "NEURON_EXTRACT_GRAPHS_ONLY": "1"})
    assert run.returncode == 0, run.stderr
    assert "writes no checkpoint, model, metrics or summary" in run.stderr
    assert not (out / "summary.json").exists() and not (out / "model").exists()
    assert not list((out / "checkpoints").glob("*")) if (out / "checkpoints").exists() else True
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()
    assert _events(read_log, "extract") and not _events(read_log, "miss")
    # a real run afterwards starts from step 0, not from anything the extraction run left; the modules were
    # only extracted, so the runtime compiles them now, just in time (the stand-in tells a miss from a hit)
    start = len(read_log())
    real = run_cli("run", *args, "--output-dir", str(out), env=env)
    assert real.returncode == 0, real.stderr
    summary = read_json(out / "summary.json")
    assert summary["resumed_from_step"] is None
    misses = [e for e in read_log()[start:] if e["event"] == "miss"]
    assert misses and not [e for e in read_log()[start:] if e["event"] == "hit"]
    assert summary["neuron_cache"]["compiled_at_run_time"] == len(misses) == summary["compilations"]
    assert summary["neuron_cache"]["cache_hits"] == 0


def test_fleet_through_s3_and_import_of_a_runtime_cache(tmp_path, recipes, neuron_runtime, s3_bucket):
    env, read_log = neuron_runtime
    bucket, client = s3_bucket
    env = {
        **env,
        **{
            k: os.environ[k]
            for k in (
                "AWS_ENDPOINT_URL",
                "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY",
                "AWS_DEFAULT_REGION",
                "AWS_EC2_METADATA_DISABLED",
            )
        },
    }
    store = f"s3://{bucket}/fleet"
    args = [
        str(recipes / "tiny-llama-clm.yaml"),
        "--set",
        f"runtime.compile_cache={store}",
        *NO_EVAL,
        "--set",
        "runtime.preflight=false",
    ]
    node1, node2 = tmp_path / "node1", tmp_path / "node2"
    pre = run_cli("precompile", *args, "--local", str(node1), "--json", str(tmp_path / "pre.json"), env=env)
    assert pre.returncode == 0, pre.stderr
    start = len(read_log())
    run = run_cli("run", *args, "--output-dir", str(tmp_path / "run"), env={**env, "NEURONTRAIN_CACHE_DIR": str(node2)})
    assert run.returncode == 0, run.stderr
    seen = read_log()[start:]
    assert seen and [e for e in seen if e["event"] == "miss"] == []
    assert set(_modules(node2)) == set(_modules(node1))

    # a cache that neuron_parallel_compile filled in S3 (runtime layout): imported, a damaged NEFF refused
    modules = sorted(node1.glob("neuronxcc-*/MODULE_*"))
    for d in modules:
        for f in d.iterdir():
            if not f.name.startswith("."):
                body = b"" if (d == modules[0] and f.name == "model.neff") else f.read_bytes()
                client.put_object(Bucket=bucket, Key=f"legacy/{d.parent.name}/{d.name}/{f.name}", Body=body)
    node3 = tmp_path / "node3"
    imp = run_cli("cache", "import", f"s3://{bucket}/legacy", "--local", str(node3), env=env)
    assert imp.returncode == 0, imp.stderr
    result = json.loads(imp.stdout)
    assert result["imported"] == len(modules) - 1 and len(result["refused"]) == 1
    assert "empty NEFF" in imp.stderr and modules[0].name in imp.stderr
    assert set(_modules(node3)) == {f"{d.parent.name}/{d.name}" for d in modules[1:]}
    for d in modules[1:]:
        assert (node3 / d.parent.name / d.name / "model.neff").read_bytes() == (d / "model.neff").read_bytes()
