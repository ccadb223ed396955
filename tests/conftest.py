import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_forkserver import ForkedCli, ForkServer, can_fork

from neurontrain.cli import main

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
RECIPES = REPO / "recipes"
_SESSION_ENV: dict[str, str] = {}  # the environment pytest_configure leaves: the CLI fork server starts with it


def pytest_configure(config: pytest.Config) -> None:
    """XLA:CPU compiles the tests' graphs at backend optimization level 0 (every process the tests start inherits
    it): the same graphs, compiled 3-4x faster than at level 1 (tiny Llama's train and eval: 0.6 s against 1.9 s;
    tiny BERT's: 1.5 s against 6.0 s), and the tiny models' steps no slower (tiny BERT, 100 steps: 26.7 and 24.5
    user s against 27.2 and 27.7). The tests compare runs with each other and with eager; the benchmarks, which
    measure speed, run at XLA's default level."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in flags:
        flags = f"{flags} --xla_backend_optimization_level=0".strip()
    # XLA:CPU's older fusion code generator: the same graphs and the same losses bit for bit (tiny Llama and tiny
    # BERT, 3 and 12 steps), compiled ~20% faster (tiny Llama's train graph 2.6-3.0 s against 3.4-3.6 s).
    if "--xla_cpu_use_fusion_emitters" not in flags:
        flags = f"{flags} --xla_cpu_use_fusion_emitters=false"
    os.environ["XLA_FLAGS"] = flags
    # One OpenMP thread a process (eager PyTorch, inductor's CPU kernels): the suite runs two files at a time on two
    # cores, each starting processes of its own, and OpenMP teams as wide as the machine spin against each other
    # (eager tiny Llama, 10 steps on a loaded host: 2.4-8 s with one thread, 14-26 s with two). torchrun workers
    # get cores / workers = 1 from the launcher anyway.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Inductor's CPU kernels as plain C++ loops, without ATen's vectorized types: the same graphs, compiled about
    # 40% faster (tiny Llama's train and eval graphs: 22 s against 35 s cold), losses within 1e-6 of the
    # vectorized kernels'. The native tests compare runs with each other and with eager; the benchmarks keep the
    # vectorized kernels.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    # The suite starts hundreds of Python processes: with PYTHONDONTWRITEBYTECODE set (some machines set it) each
    # one compiles every module it imports again; cached bytecode is what a user's install has anyway.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    # The fact cache (neurontrain/fact_cache.py) of this session only: a run of the suite derives each fact once
    # and reads it afterwards, never a fact an earlier run or another checkout left in ~/.cache.
    if "NEURONTRAIN_FACT_CACHE" not in os.environ:
        os.environ["NEURONTRAIN_FACT_CACHE"] = tempfile.mkdtemp(prefix="neurontrain-facts-")
    # The tokenized data store (neurontrain/data/store.py) of this session only, shared by its processes: a recipe's
    # data is tokenized once a run of the suite, as on a user's node, and never read from an earlier run's store.
    if "NEURONTRAIN_DATA_CACHE" not in os.environ:
        os.environ["NEURONTRAIN_DATA_CACHE"] = tempfile.mkdtemp(prefix="neurontrain-data-")
    _SESSION_ENV.update(os.environ)


# The heaviest modules first (seconds per module in a clean-clone CI run, most first): `--dist loadfile` hands
# whole files to the two workers in collection order, and a heavy file collected last keeps one worker busy while
# the other waits. Order only: every module still runs.
HEAVY_FIRST = (
    "test_scaleout.py",
    "test_native_tp.py",
    "test_families.py",
    "test_training.py",
    "test_native_cache.py",
    "test_doctor.py",
    "test_neuron_runtime.py",
    "test_torchneuron_standin.py",
    "test_lightning.py",
    "test_native_parallel.py",
    "test_native.py",
    "test_health.py",
    "test_zero1.py",
    "test_lightning_ddp.py",
    "test_checkpoint_tools.py",
    "test_precompile.py",
    "test_model_inputs_runs.py",
    "test_recipes_shipped.py",
    "test_tensor_parallel.py",
    "test_packing_runs.py",
    "test_init_from.py",
    "test_activation_checkpointing.py",
    "test_s3_cache.py",
    "test_sagemaker_toolkit.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def cli_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """`neurontrain ARGS` in this process: (exit code, stdout, stderr). The environment is restored after: a verb
    may set variables for its own process (the host-only verbs' USE_TORCH_XLA) that the processes later tests
    start must not inherit."""
    saved = dict(os.environ)
    try:
        code = main(list(args))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out = capsys.readouterr()
    return code, out.out, out.err


_fork_server: ForkServer | None = None


def _cli_fork_server() -> ForkServer | None:
    """This pytest worker's CLI fork server (tests/cli_forkserver.py), started with the session's environment on
    first use, where NEURONTRAIN_TEST_FORK_SERVER=1 asks for it; else None: a fresh interpreter every time. Off by
    default: test_precompile's run-vs-precompile graph checks failed with it (a forked run compiled a train graph
    its precompile had not), and the whole suite was no faster with it (28:36 against 28:43 from a clean clone)."""
    global _fork_server
    if os.environ.get("NEURONTRAIN_TEST_FORK_SERVER") != "1":
        return None
    if _fork_server is None:
        _fork_server = ForkServer(Path(tempfile.mkdtemp(prefix="neurontrain-cli-")), _SESSION_ENV)
    return _fork_server


def pytest_unconfigure(config: pytest.Config) -> None:
    if _fork_server is not None:
        _fork_server.stop()


def start_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> "subprocess.Popen | ForkedCli":
    """`python -m neurontrain ARGS` as a process of its own (torch-xla state never leaks between tests), stdout and
    stderr piped as text: forked from the fork server where the environment allows it, else a fresh interpreter."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    server = _cli_fork_server()
    if server is not None and can_fork(server.env, full_env):
        return server.start(list(args), cwd or REPO, full_env)
    return subprocess.Popen(
        [sys.executable, "-m", "neurontrain", *args],
        cwd=cwd or REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_cli(
    *args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run `python -m neurontrain ARGS` in a process of its own (`start_cli`) and wait for it, as subprocess.run."""
    proc = start_cli(*args, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess([sys.executable, "-m", "neurontrain", *args], proc.returncode, out, err)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def torchrun_worker_pid(output_dir: Path, rank: int) -> int | None:
    """The pid of the torchrun worker of `rank` whose command line names output_dir, or None."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            str(output_dir).encode() in cmdline
            and f"RANK={rank}".encode() in environ
            and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in environ)
        ):
            return int(proc.name)
    return None


def ray_train_worker_pids() -> list[int]:
    """Pids of the Ray Train worker processes on this machine (Ray titles them ray::RayTrainWorker...)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return sorted(pids)


def run_killing_a_worker(
    args: list[str],
    output_dir: Path,
    checkpoint_step: int,
    rank: int = 1,
    marker: Path | None = None,
    find_pid: Callable[[], int | None] | None = None,
    env: dict | None = None,
) -> tuple[int, str]:
    """`neurontrain ARGS` (a torchrun group writing to output_dir, `env` added to this environment); once its
    checkpoint of checkpoint_step is complete (or the file `marker` exists), SIGKILL worker `rank` (or the
    process find_pid names). Returns (exit code, stderr)."""
    import signal
    import time

    proc = start_cli(*args, env=env)
    marker = marker or output_dir / "checkpoints" / f"step_{checkpoint_step:08d}" / "COMPLETE"
    try:
        deadline = time.time() + 300
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, "the run ended before the checkpoint"
            time.sleep(0.05)
        pid = find_pid() if find_pid is not None else torchrun_worker_pid(output_dir, rank)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stderr


@pytest.fixture
def recipes() -> Path:
    return RECIPES


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A local S3-compatible server (moto in server mode) on 127.0.0.1; yields the env that points boto3 at it."""
    import time
    import urllib.request

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.2)
    env = {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    yield env
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, request):
    """A fresh bucket on the local server; the test's environment points at the server."""
    import re

    import boto3

    for k, v in s3_server.items():
        monkeypatch.setenv(k, v)
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-") + "-b"
    client = boto3.client("s3", endpoint_url=s3_server["AWS_ENDPOINT_URL"])
    client.create_bucket(Bucket=name)
    return name, client


STANDIN = REPO / "tests" / "standin"


def standin_runtime(root: Path) -> tuple[dict, Callable[[], list[dict]]]:
    """The environment of a host with the stand-in Neuron runtime (tests/standin/runtime): libneuronxla on the
    path, neuronx-cc and the stand-in compile on PATH, a secret module-key salt, and the log of every compile
    the runtime saw under `root`. Returns (env, read_log)."""
    import secrets

    log = root / "runtime-events.jsonl"
    env = {
        "PYTHONPATH": os.pathsep.join([str(STANDIN / "runtime"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PATH": os.pathsep.join([str(STANDIN), os.environ["PATH"]]),
        "NEURON_STANDIN_SALT": secrets.token_hex(16),
        "NEURON_STANDIN_LOG": str(log),
        "STANDIN_CC_SECONDS": "0.05",
    }
    for key in (
        "NEURON_CC_FLAGS",
        "NEURON_COMPILE_CACHE_URL",
        "NEURON_EXTRACT_GRAPHS_ONLY",
        "NEURON_PLATFORM_TARGET_OVERRIDE",
    ):
        env[key] = ""  # never inherited from the machine running the tests

    def read_log() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return env, read_log


@pytest.fixture
def neuron_runtime(tmp_path):
    """The stand-in Neuron runtime for one test (`standin_runtime`). Yields (env, read_log)."""
    yield standin_runtime(tmp_path)


class _NoProcesses(subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        raise AssertionError(f"a unit test started a process ({args!r}); move the test to tests/integration")


@pytest.fixture(autouse=True)
def _unit_tests_start_no_processes(request, monkeypatch):
    """The unit tier (tests/unit) starts no processes: a test that does is an integration test."""
    if (REPO / "tests" / "unit") in Path(request.node.path).parents:
        monkeypatch.setattr(subprocess, "Popen", _NoProcesses)
