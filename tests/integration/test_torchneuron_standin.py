"""The native path on a TorchNeuron host, against the stand-in (tests/standin/torchneuron: torch-neuronx 2.14 as
Neuron documents it, torch_xla absent, its `neuron` device holding tensors in host memory): `auto` is native on
the `neuron` device; health and run create the `neuron` process group before anything touches the device, with 1
and 2 workers, each worker seeing the cores the process group gave it, and finish; the NEFF cache is shared:
`precompile --nproc-per-node 2` pushes the plan's entry (DDP, and FSDP2) to the local S3 server, and both workers
of a run on a fresh node (empty local cache, empty NEFF directory) load every module from it, compiling none, with
the losses of a run that compiled them; and a rank whose batches take another bucket is named before it hangs.

The stand-in builds its device (a C++ extension) once per machine, in torch's extension cache; without a C++
compiler these tests are skipped."""

import importlib.util
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest
from conftest import RECIPES, REPO, cli_in_process, read_json, run_cli
from rank_hooks import DIVERGE_RANK1
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
# unpacked: packed sequence classification under the stand-in's fullgraph compile breaks the graph at transformers'
# output-capturing ContextVar (docs/status.md); the fleet and rank checks here are about the cache, not packing
for item in (
    "data.packing=off",
    "train.max_steps=2",
    "data.train_samples=64",
    "data.eval_samples=8",
    "train.schedule.warmup_steps=1",
):
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


STRATEGIES = {  # the stand-in's process group runs no functional collective: FSDP2's whole-weights export is off
    "ddp": [],
    "fsdp": ["--set", "parallel.fsdp=true", "--set", "checkpoint.save_final=false"],
}
MODULES = 3  # NEFFs of the plan: the train graph's forward and backward modules, the eval graph's inference module
LAYOUT = ["--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def shared(tmp_path_factory, s3_server) -> dict:
    """For DDP and for FSDP2: precompile for 2 workers to the S3 store beside a cold 2-worker run on a node of its
    own; then, for both, a 2-worker run on a fresh node (empty local cache and NEFF directory) from the store.
    Each process logs to its own file."""
    root = tmp_path_factory.mktemp("torchneuron-shared")
    credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=s3_server["AWS_ENDPOINT_URL"], **credentials)
    s3.create_bucket(Bucket="torchneuron-cache")
    url = "s3://torchneuron-cache/team"
    sets = [*SETS, "--set", f"runtime.expected_devices={CORES // 2}", "--set", "checkpoint.every=0"]
    for name, extra in STRATEGIES.items():
        with ThreadPoolExecutor(2) as pool:
            precompile = pool.submit(
                run_cli, "precompile", RECIPE, "--backend", "native", *LAYOUT, "--cache", url,
                "--local", str(root / f"{name}-node-a"), *sets, *extra, "--json", str(root / f"{name}-precompile.json"),
                env={**s3_server, **_env(root, f"{name}-precompile")},
            )  # fmt: skip
            cold = pool.submit(
                run_cli, "run", RECIPE, "--backend", "native", *LAYOUT, *sets, *extra,
                "--set", f"runtime.compile_cache={root / f'{name}-node-b'}", "--output-dir", str(root / f"{name}-cold"),
                env=_env(root, f"{name}-cold"),
            )  # fmt: skip
            precompile, cold = precompile.result(), cold.result()
        assert precompile.returncode == 0, precompile.stderr[-3000:]
        assert cold.returncode == 0, cold.stderr[-3000:]
    with ThreadPoolExecutor(2) as pool:  # a fresh node for each
        warm = {
            name: pool.submit(
                run_cli,
                "run",
                RECIPE,
                "--backend",
                "native",
                *LAYOUT,
                *sets,
                *extra,
                "--set",
                f"runtime.compile_cache={url}",
                "--output-dir",
                str(root / f"{name}-warm"),
                env={**s3_server, **_env(root, f"{name}-warm"), "NEURONTRAIN_CACHE_DIR": str(root / f"{name}-node-c")},
            )  # fmt: skip
            for name, extra in STRATEGIES.items()
        }
        warm = {name: future.result() for name, future in warm.items()}
    for result in warm.values():
        assert result.returncode == 0, result.stderr[-3000:]
    entries = [o["Key"] for o in s3.list_objects_v2(Bucket="torchneuron-cache")["Contents"] if "ENTRY" in o["Key"]]
    stored = {e: sorted(json.loads(s3.get_object(Bucket="torchneuron-cache", Key=e)["Body"].read())["files"])
              for e in entries}  # fmt: skip
    return {"root": root, "stored": stored, "url": url}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_cold_two_worker_run_compiles_every_module_after_its_process_group(shared, name):
    root = shared["root"]
    _workers_in_order(root, 2, f"{name}-cold")
    assert set(_kinds(root, f"{name}-cold")) <= {"neff compiled", "neff loaded"}  # a peer may have written it first
    assert len(list((root / f"{name}-node-b" / "torchneuron-neff").rglob("*.neff"))) == MODULES
    summary = read_json(root / f"{name}-cold" / "summary.json")
    assert (summary["world_size"], summary["steps"], summary["unexpected_graphs"]) == (2, 2, 0)
    workers = summary["compile_cache"]["native"]["workers"]
    assert [(w["rank"], w["loaded"], w["neff_cache"]["compiled"]) for w in workers] == [(0, False, MODULES),
                                                                                       (1, False, MODULES)]  # fmt: skip
    # the workers compared their shapes where the plan introduces a graph only: step 1 (train 96), eval batch 0
    assert summary["rank_checks"] == {"exchanges": 2, "at": ["step-1", "eval-batch-0"]}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_precompile_for_two_workers_compiles_each_graph_once_and_pushes_its_neffs(shared, name):
    report = read_json(shared["root"] / f"{name}-precompile.json")
    assert (report["target"], report["workers"], report["ranks_compiled"]) == ("neuron", 2, {"0": [0, 1]})
    assert (report["planned_graphs"], report["graphs_compiled"]) == (PLANNED, PLANNED)
    assert _kinds(shared["root"], f"{name}-precompile") == ["neff compiled"] * MODULES
    entry = f"team/entries/{report['entry']}/ENTRY.json"
    assert "neff.tar" in shared["stored"][entry], shared["stored"]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_two_workers_on_a_fresh_node_load_every_module_from_the_shared_cache(shared, name):
    root = shared["root"]
    _workers_in_order(root, 2, f"{name}-warm")
    assert _kinds(root, f"{name}-warm") == ["neff loaded"] * (2 * MODULES)  # TorchNeuron compiled nothing
    summary = read_json(root / f"{name}-warm" / "summary.json")
    native = summary["compile_cache"]["native"]
    assert summary["compile_cache"]["pulled"]["entries"] == 1  # once for the node, by the launching process
    assert native["node"]["refused"] is None
    assert native["node"]["neff_cache"] == {
        "dir": str(root / f"{name}-node-c" / "torchneuron-neff"),
        "restored": MODULES,
    }
    for worker in native["workers"]:
        assert worker["loaded"] and worker["refused"] is None and worker["neff_cache"]["compiled"] == 0, worker
    cold = read_json(root / f"{name}-cold" / "summary.json")
    losses = ("first_loss", "final_loss", "eval_loss")
    assert [summary[k] for k in losses] == [cold[k] for k in losses]  # the same graphs, loaded instead of compiled


def test_cache_status_lists_the_native_entries_of_every_layout(shared, s3_server, capsys, monkeypatch):
    monkeypatch.setenv("USE_TORCH_XLA", "1")  # selecting native sets it to 0 for transformers: keep that here
    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    local = str(shared["root"] / "ddp-node-a")
    args = ["cache", "status", RECIPE, "--backend", "native", "--nproc-per-node", "2", "--cache", shared["url"]]
    code, out, err = cli_in_process(capsys, *args, "--local", local, *SETS)
    listed = [line for line in out.splitlines() if line.startswith("  native entry")]
    assert code == 0 and len(listed) == 2, out + err
    assert sum(line.endswith("2 worker(s), neuron local, remote") for line in listed) == 1, out
    assert sum(line.endswith("workers unknown (not local), ? remote") for line in listed) == 1, out


def test_a_diverging_rank_is_named_with_its_shapes_before_a_collective_hangs(tmp_path):
    env = without_torch_xla(tmp_path / "site", also=DIVERGE_RANK1)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(STANDIN)])
    env.update(TORCHNEURON_STANDIN_CORES=str(CORES), TORCHNEURON_STANDIN_DEVICE="1",
               NEURONTRAIN_TEST_DIVERGE=str(tmp_path))  # fmt: skip
    args = ["run", RECIPE, "--backend", "native", *LAYOUT, *SETS, "--set", f"runtime.expected_devices={CORES // 2}"]
    args += ["--set", "runtime.collective_timeout=600", "--no-preflight", "--output-dir", str(tmp_path / "run")]
    args += ["--set", "data.packing=off"]  # batches of data.batch_size samples, the shapes named below
    result = run_cli(*args, env=env)
    ended = time.time()
    assert result.returncode == 1, result.stderr[-3000:]
    named = "workers diverge at step 1 (train): rank 1 has input_ids [16, 48], where the plan has [16, 96] (as ranks 0)"
    assert named in result.stderr, result.stderr[-3000:]
    assert ended - float((tmp_path / "diverged_at").read_text()) < 30  # not the collective's 600 s
