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
from types import SimpleNamespace

import pytest
from conftest import RECIPES, REPO, read_json, run_cli, standin_runtime

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


AWS_KEYS = (
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION",
    "AWS_EC2_METADATA_DISABLED",
)


@pytest.fixture(scope="module")
def bert_fleet(tmp_path_factory, s3_server):
    """The BERT family (with the preflight's device-check graphs) precompiled on one node into an S3 store, then
    run on another node that pulls it: one precompile and one run, read by the cache-hit and the fleet tests."""
    import boto3

    root = tmp_path_factory.mktemp("bert-fleet")
    env, read_log = standin_runtime(root)
    env = {**env, **s3_server}
    client = boto3.client("s3", endpoint_url=s3_server["AWS_ENDPOINT_URL"], **_credentials(s3_server))
    bucket = "bert-fleet-b"
    client.create_bucket(Bucket=bucket)
    args = [str(RECIPES / "tiny-bert-classification.yaml"), "--set", f"runtime.compile_cache=s3://{bucket}/fleet"]
    args += SHORT
    node1, node2 = root / "node1", root / "node2"
    report = _precompile(args, env, root, "pre", "--local", str(node1))
    extracted = {e["module"] for e in _events(read_log, "extract")}
    compile_phases = _events(read_log, "parallel_compile")
    start = len(read_log())
    run = run_cli("run", *args, "--output-dir", str(root / "run"), env={**env, "NEURONTRAIN_CACHE_DIR": str(node2)})
    assert run.returncode == 0, run.stderr
    return SimpleNamespace(
        env=env,
        bucket=bucket,
        client=client,
        node1=node1,
        node2=node2,
        report=report,
        extracted=extracted,
        compile_phases=compile_phases,
        run_events=read_log()[start:],
        summary=read_json(root / "run" / "summary.json"),
    )


def _credentials(server_env: dict) -> dict:
    return {
        "aws_access_key_id": server_env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": server_env["AWS_SECRET_ACCESS_KEY"],
        "region_name": server_env["AWS_DEFAULT_REGION"],
    }


def test_after_precompile_every_run_graph_is_a_cache_hit(bert_fleet):
    """The BERT family, with the preflight's device-check graphs, precompiled on node 1 and run on node 2 through
    the S3 store; the Llama family's one- and two-worker runs (the doctor's recipe, on a local cache) are checked
    the same way in test_doctor.py, on `neurontrain doctor --quick`'s runs."""
    report, cache = bert_fleet.report, bert_fleet.node1
    manifest = read_json(report["manifest"])
    named = {m for g in manifest["graphs"] for m in g["modules"]}
    # the manifest names exactly the directories the runtime created, each compiled by its parallel compile phase
    assert named == bert_fleet.extracted
    assert set(_modules(cache)) == named
    assert all({"model.neff", "model.done"} <= files for files in _modules(cache).values())
    assert report["failed"] == 0 and report["compiled"] == len(named)
    assert all(g["modules"] for g in manifest["graphs"])
    # no --workers: the compile pool's size is passed, one per 64 GiB of this host's memory
    assert [e["num_parallel"] for e in bert_fleet.compile_phases] == [default_compile_workers(host_memory_bytes())]

    seen = bert_fleet.run_events
    assert seen and [e for e in seen if e["event"] == "miss"] == []
    assert {e["module"] for e in seen if e["event"] == "hit"} == named
    summary = bert_fleet.summary
    assert summary["neuron_cache"]["compiled_at_run_time"] == 0
    assert summary["neuron_cache"]["cache_hits"] == summary["compilations"] > 0


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


def _precompile_killed_mid_compile(args, env, tmp_path, cache):
    """`neurontrain precompile ARGS` SIGKILLed once its first compiler started: no compiler, no compile process
    and no poisoned (failed) module entry may be left in `cache`."""
    cc_log = tmp_path / "cc.log"
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
        time.sleep(0.1)
    compilers = [int(line.split()[1]) for line in cc_log.read_text().splitlines()]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while (any(_alive(p) for p in compilers) or _processes_mentioning(str(cache))) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in compilers), "a compiler outlived precompile"
    assert _processes_mentioning(str(cache)) == [], "a compile process outlived precompile"
    assert not list(cache.glob("neuronxcc-*/MODULE_*/model.log"))


def test_sigkill_mid_compile_then_a_rerun_in_the_cache_dir_flag_cache_for_the_hosts_target(
    tmp_path, recipes, neuron_runtime
):
    """A precompile SIGKILLed mid compile leaves no compiler and no poisoned entry: the precompile run again
    afterwards (in the cache NEURON_CC_FLAGS' --cache_dir names) compiles every module; that rerun is also the
    one whose cache location, target and compiler command lines are checked."""
    env, _ = neuron_runtime
    flagged, recipe_cache, argv_log = tmp_path / "flagged", tmp_path / "recipe-cache", tmp_path / "argv.jsonl"
    env = {
        **env,
        "NEURON_CC_FLAGS": f"--cache_dir={flagged} --retry_failed_compilation --log_level=INFO",
        "STANDIN_INSTANCE_TYPE": "trn2.48xlarge",
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
    _precompile_killed_mid_compile(args, env, tmp_path, flagged)

    env = {**env, "STANDIN_CC_ARGV_LOG": str(argv_log)}
    report = _precompile(args, env, tmp_path, "pre")
    assert report["failed"] == 0 and report["compiled"] + report["already_cached"] >= 1
    assert all(g["status"] in ("compiled", "cached") for g in report["graphs"])
    assert Path(report["manifest"]).is_relative_to(flagged)
    assert not recipe_cache.exists() or not any(recipe_cache.rglob("*"))
    # the killed precompile extracted every module and compiled none: the rerun compiles them all
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


def test_fleet_through_s3_and_import_of_a_runtime_cache(tmp_path, bert_fleet):
    """Node 2 ran from what node 1 precompiled into the S3 store (its run: no miss, the cache-hit test); then a
    cache that neuron_parallel_compile filled in S3 (runtime layout) is imported, a damaged NEFF refused."""
    client, bucket, node1 = bert_fleet.client, bert_fleet.bucket, bert_fleet.node1
    assert set(_modules(bert_fleet.node2)) == set(_modules(node1))

    modules = sorted(node1.glob("neuronxcc-*/MODULE_*"))
    for d in modules:
        for f in d.iterdir():
            if not f.name.startswith("."):
                body = b"" if (d == modules[0] and f.name == "model.neff") else f.read_bytes()
                client.put_object(Bucket=bucket, Key=f"legacy/{d.parent.name}/{d.name}/{f.name}", Body=body)
    node3 = tmp_path / "node3"
    imp = run_cli("cache", "import", f"s3://{bucket}/legacy", "--local", str(node3), env=bert_fleet.env)
    assert imp.returncode == 0, imp.stderr
    result = json.loads(imp.stdout)
    assert result["imported"] == len(modules) - 1 and len(result["refused"]) == 1
    assert "empty NEFF" in imp.stderr and modules[0].name in imp.stderr
    assert set(_modules(node3)) == {f"{d.parent.name}/{d.name}" for d in modules[1:]}
    for d in modules[1:]:
        assert (node3 / d.parent.name / d.name / "model.neff").read_bytes() == (d / "model.neff").read_bytes()
