"""Precompile vs trial-run extraction through the (stand-in) Neuron runtime, graph discovery vs a trial run,
and parallel vs one-at-a-time cache transfers. Prints one JSON object.

    python benchmarks/compile_cache.py [--entries 240] [--recipe recipes/tiny-bert-classification.yaml]

Runtime extraction: on the stand-in runtime of the tests, `precompile` against neuron_parallel_compile's way
(the training script for --trial-steps steps with NEURON_EXTRACT_GRAPHS_ONLY=1, then the runtime's parallel
compile): modules found and missed (a module is a graph as the runtime names it), wall seconds of the commands.

Discovery: `neurontrain precompile` traces every planned graph without executing it; the alternative
(neuron_parallel_compile's approach) runs the training script for 10 trial steps and collects the graphs it
happened to meet. Both run in fresh processes on XLA:CPU; seconds are the work itself (from the reports),
not interpreter start-up. Transfers: a local S3-compatible server (moto, 127.0.0.1) and --entries cache
entries of 16-256 KiB; push and pull (in this process, timed around the store calls) with 1 transfer at a
time and with --workers at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, "-m", "neurontrain", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if res.returncode != 0:
        raise SystemExit(f"{args[:2]} failed: {res.stderr[-2000:]}")
    return res


def discovery_vs_trial(recipe: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        # fixed buckets, so the trial run's plan does not change with its step count
        # (a 256 bucket for the rare long reviews: the graphs a short trial run is likely to miss)
        sets = [
            "--set",
            f"runtime.compile_cache={tmp}/cache",
            "--set",
            "data.buckets=[32,64,128,256]",
            "--set",
            "data.max_length=256",
            "--set",
            "model.config.max_position_embeddings=256",
            "--set",
            f"train.max_steps={steps}",
        ]
        cli("precompile", recipe, *sets, "--json", f"{tmp}/pre.json")
        report = json.loads(Path(f"{tmp}/pre.json").read_text())
        manifest = json.loads(Path(report["manifest"]).read_text())
        trial_sets = sets[:8] + [
            "--set",
            "train.max_steps=10",
            "--set",
            "train.schedule.warmup_steps=2",
            "--set",
            "checkpoint.every=0",
            "--set",
            "checkpoint.save_final=false",
        ]
        cli("run", recipe, *trial_sets, "--output-dir", f"{tmp}/trial")
        trial = json.loads(Path(f"{tmp}/trial/summary.json").read_text())
    graphs = len(manifest["graphs"])
    return {
        "planned_steps": steps,
        "discovery": {
            "graphs": graphs,
            "seconds": manifest["discovery_seconds"],
            "seconds_per_graph": round(manifest["discovery_seconds"] / graphs, 3),
        },
        "trial_run_10_steps": {
            "graphs_seen": trial["distinct_graphs"],
            "graphs_missed": graphs - trial["distinct_graphs"],
            "seconds": round(trial["wall_seconds"], 2),
            "seconds_per_graph_seen": round(trial["wall_seconds"] / trial["distinct_graphs"], 3),
        },
        "discovery_speedup_per_graph": round(
            (trial["wall_seconds"] / trial["distinct_graphs"]) / (manifest["discovery_seconds"] / graphs), 1
        ),
    }


def standin_runtime_env(log: Path) -> dict:
    """The stand-in Neuron runtime of the tests (tests/standin/runtime): modules keyed by the module XLA compiled."""
    standin = REPO / "tests" / "standin"
    return {
        "PYTHONPATH": str(standin / "runtime"),
        "PATH": f"{standin}{os.pathsep}{os.environ['PATH']}",
        "NEURON_STANDIN_SALT": os.urandom(8).hex(),
        "NEURON_STANDIN_LOG": str(log),
        "STANDIN_CC_SECONDS": "0.05",
        "NEURON_CC_FLAGS": "",
        "NEURON_COMPILE_CACHE_URL": "",
        "NEURON_EXTRACT_GRAPHS_ONLY": "",
    }


def runtime_extraction(recipe: str, steps: int, trial_steps: int) -> dict:
    """On the stand-in runtime: `precompile` (discovery by construction, each graph extracted by the runtime,
    then its parallel compile) against neuron_parallel_compile's way (the training script run for a few
    steps with NEURON_EXTRACT_GRAPHS_ONLY=1, then the same parallel compile). Wall seconds of the commands."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "events.jsonl"
        env = standin_runtime_env(log)
        sets = [
            "--set",
            "data.buckets=[32,64,128,256]",
            "--set",
            "data.max_length=256",
            "--set",
            "model.config.max_position_embeddings=256",
            "--set",
            f"train.max_steps={steps}",
        ]
        t0 = time.perf_counter()
        cli(
            "precompile", recipe, *sets, "--set", f"runtime.compile_cache={tmp}/a", "--json", f"{tmp}/pre.json", env=env
        )
        precompile_seconds = time.perf_counter() - t0
        manifest = json.loads(Path(json.loads(Path(f"{tmp}/pre.json").read_text())["manifest"]).read_text())
        planned = {m for g in manifest["graphs"] for m in g["modules"]}
        trial_env = {**env, "NEURON_EXTRACT_GRAPHS_ONLY": "1", "NEURON_COMPILE_CACHE_URL": f"{tmp}/b"}
        log.write_text("")
        t0 = time.perf_counter()
        cli(
            "run",
            recipe,
            *sets[:6],
            "--set",
            f"train.max_steps={trial_steps}",
            "--set",
            "train.schedule.warmup_steps=2",
            "--set",
            f"runtime.compile_cache={tmp}/b",
            "--output-dir",
            f"{tmp}/trial",
            env=trial_env,
        )
        subprocess.run(
            [sys.executable, "-m", "libneuronxla.neuron_parallel_compile", "--command", "compile"],
            env={**os.environ, **env, "NEURON_COMPILE_CACHE_URL": f"{tmp}/b"},
            capture_output=True,
            check=True,
            cwd=tmp,
        )
        trial_seconds = time.perf_counter() - t0
        seen = {
            json.loads(line)["module"]
            for line in log.read_text().splitlines()
            if json.loads(line)["event"] == "extract"
        }
    return {
        "planned_steps": steps,
        "precompile": {"graphs_found": len(planned), "graphs_missed": 0, "seconds": round(precompile_seconds, 1)},
        f"trial_extraction_{trial_steps}_steps": {
            "graphs_found": len(seen & planned),
            "graphs_missed": len(planned - seen),
            "seconds": round(trial_seconds, 1),
        },
    }


def fake_cache(root: Path, entries: int) -> int:
    rng = random.Random(0)
    total = 0
    for i in range(entries):
        d = root / "graphs" / f"{i:032x}"
        d.mkdir(parents=True)
        data = rng.randbytes(rng.randint(16, 256) * 1024)
        (d / "model.hlo_module.pb").write_bytes(data)
        total += len(data)
    return total


def transfers(entries: int, workers: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(env["AWS_ENDPOINT_URL"], timeout=1)
                break
            except Exception:
                time.sleep(0.2)
        import boto3

        boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        ).create_bucket(Bucket="bench")
        out: dict = {"entries": entries}
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "src"
            size = fake_cache(src, entries)
            out["bytes"] = size
            os.environ.update(env)
            from neurontrain.compile.s3 import S3Store

            for label, n in (("one_at_a_time", 1), ("parallel", workers)):
                store = S3Store(f"s3://bench/{label}", workers=n)
                store.check()
                t0 = time.perf_counter()
                assert store.push(src).entries == entries
                push = time.perf_counter() - t0
                t0 = time.perf_counter()
                assert store.pull(Path(tmp) / label).entries == entries
                pull = time.perf_counter() - t0
                out[label] = {
                    "workers": n,
                    "push_seconds": round(push, 2),
                    "pull_seconds": round(pull, 2),
                    "push_entries_per_second": round(entries / push, 1),
                    "pull_entries_per_second": round(entries / pull, 1),
                    "push_MB_per_second": round(size / push / 1e6, 2),
                    "pull_MB_per_second": round(size / pull / 1e6, 2),
                }
        out["push_speedup"] = round(out["one_at_a_time"]["push_seconds"] / out["parallel"]["push_seconds"], 2)
        out["pull_speedup"] = round(out["one_at_a_time"]["pull_seconds"] / out["parallel"]["pull_seconds"], 2)
        return out
    finally:
        server.terminate()
        server.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny-bert-classification.yaml"))
    parser.add_argument("--steps", type=int, default=100, help="planned steps of the recipe (auto buckets use it)")
    parser.add_argument("--entries", type=int, default=240)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--trial-steps", type=int, default=10)
    args = parser.parse_args()
    print(
        json.dumps(
            {
                "runtime_extraction": runtime_extraction(args.recipe, args.steps, args.trial_steps),
                "discovery": discovery_vs_trial(args.recipe, args.steps),
                "transfers": transfers(args.entries, args.workers),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
