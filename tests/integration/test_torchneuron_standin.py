"""The native path on a TorchNeuron host, against the stand-in (tests/standin/torchneuron: torch-neuronx 2.14 as
Neuron documents it, torch_xla absent, its `neuron` device holding tensors in host memory): `auto` is native on
the `neuron` device; health and run create the `neuron` process group before anything touches the device, with 1
and 2 workers, each worker seeing the cores the process group gave it, and finish; and the NEFF cache is shared:
`precompile` pushes the plan's entry to the local S3 server, and a run on a fresh node (empty local cache, empty
NEFF directory) pulls it and loads every graph, compiling none, with the losses of a run that compiled them.

The stand-in builds its device (a C++ extension) once per machine, in torch's extension cache; without a C++
compiler these tests are skipped."""

import importlib.util
import json
import os
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest
from conftest import RECIPES, REPO, read_json, run_cli
from torch_xla_blocker import without_torch_xla

STANDIN = REPO / "tests" / "standin" / "torchneuron"
_spec = importlib.util.spec_from_file_location("standin_device", STANDIN / "torch_neuronx" / "_device.py")
_device = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_device)  # stdlib only: whether the stand-in can build its device here

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        _device.compiler_missing() is not None, reason=f"TorchNeuron stand-in: {_device.compiler_missing()}"
    ),
]

CORES = 8  # the stand-in's host
RECIPE = str(RECIPES / "tiny-bert-classification.yaml")
SETS = []
for item in ("train.max_steps=2", "data.train_samples=64", "data.eval_samples=8", "train.schedule.warmup_steps=1"):
    SETS += ["--set", item]
PLANNED = 2  # train 96 and eval 96


def _env(root, log: str = "standin") -> dict:
    env = without_torch_xla(root / "blocker")
    paths = [env["PYTHONPATH"], str(STANDIN), os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["TORCHNEURON_STANDIN_LOG"] = str(root / f"{log}.jsonl")
    env["TORCHNEURON_STANDIN_CORES"] = str(CORES)
    env["TORCHNEURON_STANDIN_DEVICE"] = "1"
    return env


def _events(root, log: str = "standin") -> dict[int, list[dict]]:
    by_pid: dict[int, list[dict]] = {}
    for line in (root / f"{log}.jsonl").read_text().splitlines():
        event = json.loads(line)
        by_pid.setdefault(event["pid"], []).append(event)
    return by_pid


def _kinds(root, log: str) -> list[str]:
    return [e["event"] for ev in _events(root, log).values() for e in ev if e["event"].startswith("neff")]


def _workers_in_order(root, workers: int, log: str = "standin") -> None:
    """Every process that used the device created the process group first, with its share of the cores."""
    users = {pid: ev for pid, ev in _events(root, log).items() if any(e["event"] != "imported" for e in ev)}
    assert all(e["event"] != "refused process group" for ev in users.values() for e in ev), users
    groups = [e for ev in users.values() for e in ev if e["event"] == "process group"]
    assert len(groups) == workers, users
    per_worker = CORES // workers
    want = {f"{r * per_worker}-{r * per_worker + per_worker - 1}" for r in range(workers)}
    assert {g["visible_cores"] for g in groups} == want
    for ev in users.values():
        kinds = [e["event"] for e in ev if e["event"] in ("process group", "runtime initialised")]
        assert kinds == ["process group", "runtime initialised"], ev


def test_auto_is_native_on_the_neuron_device(tmp_path):
    env = _env(tmp_path)
    result = run_cli("env", "--json", env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    info = json.loads(result.stdout)
    assert (info["backend"], info["device"], info["torch_compile_backend"]) == ("native", "neuron:0", "neuron")
    assert "active in" in (tmp_path / "blocker" / "blocked.log").read_text()  # torch_xla was not importable


@pytest.mark.parametrize("workers", [1, 2])
def test_health_creates_the_process_group_before_the_device(tmp_path, workers):
    args = [
        "health",
        "--backend",
        "native",
        "--nproc-per-node",
        str(workers),
        "--expect-devices",
        str(CORES // workers),
    ]
    args += ["--timeout", "60", "--sizes", "1K", "--iters", "1", "--work-dir", str(tmp_path / "work")]
    result = run_cli(*args, "--json", str(tmp_path / "out.json"), env=_env(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    _workers_in_order(tmp_path, workers)
    for rank in range(workers):
        checks = {r["check"]: r for r in json.loads((tmp_path / "work" / f"rank{rank}.json").read_text())["results"]}
        assert {"device matmul", "device compile", "all_reduce 1024B", "reduce_scatter 1024B"} <= set(checks)
        assert all(c["ok"] for c in checks.values()), checks


def test_run_with_two_workers_creates_the_process_group_before_the_device(tmp_path):
    args = ["run", RECIPE, "--backend", "native", "--nproc-per-node", "2", "--output-dir", str(tmp_path / "run")]
    result = run_cli(*args, *SETS, "--set", f"runtime.expected_devices={CORES // 2}", env=_env(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    _workers_in_order(tmp_path, 2)
    summary = read_json(tmp_path / "run" / "summary.json")
    assert (summary["world_size"], summary["steps"], summary["unexpected_graphs"]) == (2, 2, 0)


@pytest.fixture(scope="module")
def shared(tmp_path_factory, s3_server) -> dict:
    """precompile to the S3 store beside a cold run on a node of its own, then a run on a fresh node (empty local
    cache and NEFF directory) from the store; each process logs to its own file."""
    root = tmp_path_factory.mktemp("torchneuron-shared")
    credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=s3_server["AWS_ENDPOINT_URL"], **credentials)
    s3.create_bucket(Bucket="torchneuron-cache")
    url = "s3://torchneuron-cache/team"
    sets = [*SETS, "--set", f"runtime.expected_devices={CORES}", "--set", "checkpoint.every=0"]
    with ThreadPoolExecutor(2) as pool:
        precompile = pool.submit(
            run_cli, "precompile", RECIPE, "--backend", "native", "--cache", url, "--local", str(root / "node-a"),
            *sets, "--json", str(root / "precompile.json"), env={**s3_server, **_env(root, "precompile")},
        )  # fmt: skip
        cold = pool.submit(
            run_cli, "run", RECIPE, "--backend", "native", *sets, "--set", f"runtime.compile_cache={root / 'node-b'}",
            "--output-dir", str(root / "cold"), env=_env(root, "cold"),
        )  # fmt: skip
        precompile, cold = precompile.result(), cold.result()
    assert precompile.returncode == 0, precompile.stderr[-3000:]
    assert cold.returncode == 0, cold.stderr[-3000:]
    fresh_node = {**s3_server, **_env(root, "warm"), "NEURONTRAIN_CACHE_DIR": str(root / "node-c")}
    warm = run_cli(
        "run", RECIPE, "--backend", "native", *sets, "--set", f"runtime.compile_cache={url}",
        "--output-dir", str(root / "warm"), env=fresh_node,
    )  # fmt: skip
    assert warm.returncode == 0, warm.stderr[-3000:]
    [entry] = [o["Key"] for o in s3.list_objects_v2(Bucket="torchneuron-cache")["Contents"] if "ENTRY" in o["Key"]]
    stored = json.loads(s3.get_object(Bucket="torchneuron-cache", Key=entry)["Body"].read())
    return {"root": root, "stored": {"entry": entry, "files": sorted(stored["files"])}}


def test_a_cold_run_compiles_every_graph_after_its_process_group(shared):
    _workers_in_order(shared["root"], 1, "cold")
    assert _kinds(shared["root"], "cold") == ["neff compiled"] * PLANNED
    summary = read_json(shared["root"] / "cold" / "summary.json")
    assert (summary["compilations"], summary["unexpected_graphs"]) == (PLANNED, 0)
    native = summary["compile_cache"]["native"]
    assert not native["loaded"] and (native["neff_cache"]["restored"], native["neff_cache"]["compiled"]) == (0, PLANNED)


def test_precompile_compiles_every_graph_and_pushes_its_neffs(shared):
    report = read_json(shared["root"] / "precompile.json")
    assert (report["target"], report["planned_graphs"], report["graphs_compiled"]) == ("neuron", PLANNED, PLANNED)
    assert _kinds(shared["root"], "precompile") == ["neff compiled"] * PLANNED
    assert shared["stored"]["entry"] == f"team/entries/{report['entry']}/ENTRY.json", shared["stored"]
    assert "neff.tar" in shared["stored"]["files"], shared["stored"]


def test_a_run_on_a_fresh_node_loads_every_graph_from_the_shared_cache(shared):
    root = shared["root"]
    _workers_in_order(root, 1, "warm")
    assert _kinds(root, "warm") == ["neff loaded"] * PLANNED  # TorchNeuron compiled nothing
    summary = read_json(root / "warm" / "summary.json")
    native = summary["compile_cache"]["native"]
    assert summary["compile_cache"]["pulled"]["entries"] == 1 and native["loaded"] and native["refused"] is None
    assert native["neff_cache"]["dir"] == str(root / "node-c" / "torchneuron-neff")
    assert (native["neff_cache"]["restored"], native["neff_cache"]["compiled"]) == (PLANNED, 0)
    cold = read_json(root / "cold" / "summary.json")
    losses = ("first_loss", "final_loss", "eval_loss")
    assert [summary[k] for k in losses] == [cold[k] for k in losses]  # the same graphs, loaded instead of compiled
