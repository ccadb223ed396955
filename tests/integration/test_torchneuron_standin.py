"""The native path on a TorchNeuron host, against the stand-in (tests/standin/torchneuron: torch-neuronx 2.14 as
Neuron documents it, torch_xla absent): `auto` is native on the `neuron` device, and health and run create the
`neuron` process group before anything touches the device, with 1 and 2 workers, each worker seeing the cores the
process group gave it. The stand-in cannot hold tensors (a PrivateUse1 device needs C++ kernels): the device
checks themselves fail there with PyTorch's own "Could not run 'aten::...'" error, which the tests expect."""

import json
import os

import pytest
from conftest import RECIPES, REPO, run_cli
from torch_xla_blocker import without_torch_xla

pytestmark = pytest.mark.slow

STANDIN = REPO / "tests" / "standin" / "torchneuron"
CORES = 8  # the stand-in's host
# PyTorch's own refusals of a device without C++ support: the dispatcher's (no kernel) or the device guard's
NO_DEVICE_MEMORY = ("Could not run 'aten::", "not linked with support for neuron devices")


def _env(tmp_path) -> dict:
    env = without_torch_xla(tmp_path / "blocker")
    paths = [env["PYTHONPATH"], str(STANDIN), os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["TORCHNEURON_STANDIN_LOG"] = str(tmp_path / "standin.jsonl")
    env["TORCHNEURON_STANDIN_CORES"] = str(CORES)
    env["TORCHNEURON_STANDIN_DEVICE"] = "1"
    return env


def _events(tmp_path) -> dict[int, list[dict]]:
    by_pid: dict[int, list[dict]] = {}
    for line in (tmp_path / "standin.jsonl").read_text().splitlines():
        event = json.loads(line)
        by_pid.setdefault(event["pid"], []).append(event)
    return by_pid


def _workers_in_order(tmp_path, workers: int) -> None:
    """Every process that used the device created the process group first, with its share of the cores."""
    users = {pid: ev for pid, ev in _events(tmp_path).items() if any(e["event"] != "imported" for e in ev)}
    assert all(e["event"] != "refused process group" for ev in users.values() for e in ev), users
    groups = [e for ev in users.values() for e in ev if e["event"] == "process group"]
    assert len(groups) == workers, users
    per_worker = CORES // workers
    want = {f"{r * per_worker}-{r * per_worker + per_worker - 1}" for r in range(workers)}
    assert {g["visible_cores"] for g in groups} == want
    for ev in users.values():
        kinds = [e["event"] for e in ev if e["event"] in ("process group", "runtime initialised")]
        assert kinds[0] == "process group", ev


def test_auto_is_native_on_the_neuron_device(tmp_path):
    env = _env(tmp_path)
    result = run_cli("env", "--json", env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    info = json.loads(result.stdout)
    assert (info["backend"], info["device"], info["torch_compile_backend"]) == ("native", "neuron:0", "neuron")
    assert "active in" in (tmp_path / "blocker" / "blocked.log").read_text()  # torch_xla was not importable


@pytest.mark.parametrize("workers", [1, 2])
def test_health_creates_the_process_group_before_the_device(tmp_path, workers):
    out = tmp_path / "out.json"
    args = [
        "health",
        "--backend",
        "native",
        "--nproc-per-node",
        str(workers),
        "--expect-devices",
        str(CORES // workers),
    ]
    args += [
        "--timeout",
        "60",
        "--sizes",
        "1K",
        "--iters",
        "1",
        "--work-dir",
        str(tmp_path / "work"),
        "--json",
        str(out),
    ]
    result = run_cli(*args, env=_env(tmp_path))
    assert result.returncode == 3, result.stderr[-2000:]  # the device checks: the stand-in has no device memory
    _workers_in_order(tmp_path, workers)
    for rank in range(workers):
        checks = {r["check"]: r for r in json.loads((tmp_path / "work" / f"rank{rank}.json").read_text())["results"]}
        assert checks["rendezvous"]["ok"] and checks["device count"]["ok"], checks
        assert any(marker in json.dumps(checks["device matmul"]) for marker in NO_DEVICE_MEMORY)


@pytest.mark.parametrize("workers", [1, 2])
def test_run_and_its_preflight_create_the_process_group_before_the_device(tmp_path, workers):
    args = ["run", str(RECIPES / "tiny-bert-classification.yaml"), "--backend", "native"]
    args += ["--nproc-per-node", str(workers), "--output-dir", str(tmp_path / "run"), "--set", "train.max_steps=2"]
    args += ["--set", "data.train_samples=64", "--set", "data.eval_samples=8"]
    args += ["--set", "train.schedule.warmup_steps=1", "--set", f"runtime.expected_devices={CORES // workers}"]
    result = run_cli(*args, env=_env(tmp_path))
    assert result.returncode != 0 and any(m in result.stderr for m in NO_DEVICE_MEMORY), result.stderr[-2000:]
    _workers_in_order(tmp_path, workers)
