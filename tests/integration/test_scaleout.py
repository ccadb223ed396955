"""Data-parallel runs with real torchrun workers on XLA:CPU (gloo between them), elastic restart after a
SIGKILL, bad combinations, a real Slurm (two nodes on this machine) running the generated sbatch script, and
the 2-worker BERT run with its batches made on the data node of a loopback Ray cluster (`run --launcher ray`,
data.service.kind ray), a worker killed and restarted, compared with it: the cluster `--local-cluster
data=1,trainium=1` starts, joined through RAY_ADDRESS."""

import json
import resource
import time
from pathlib import Path

import pytest
from conftest import (
    RECIPES,
    cli_in_process,
    ray_train_worker_pids,
    read_json,
    read_metrics,
    run_cli,
    run_killing_a_worker,
)
from rank_hooks import diverging_rank1

from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe

pytestmark = pytest.mark.slow

LLAMA = str(RECIPES / "tiny-llama-clm.yaml")
BERT = str(RECIPES / "tiny-bert-classification.yaml")
LLAMA_ARGS = [
    "--set",
    "train.max_steps=16",
    "--set",
    "train.log_every=1",
    "--set",
    "checkpoint.every=4",
    "--set",
    "data.buckets=[128]",
    "--set",
    "data.packing=off",  # one worker of 16 samples and two of 8: the same global batch
]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def _assert_curves_match(one: Path, two: Path, steps: int) -> None:
    a, b = _losses(one), _losses(two)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
    assert worst < 1e-3, f"2-worker loss differs from 1-worker by {worst:.2e} relative"


# Two Slurm "nodes" on this machine, each with its own loopback address. A c10d rendezvous sorts its
# participants' ids, which start with the address as a string: "127.0.0.10" < "127.0.0.9", so it would make nodeb
# rank 0, while the first host of the job's node list (node 0) is nodea.
NODES = {"nodea": "127.0.0.9", "nodeb": "127.0.0.10"}
RECORDER = """import json, os, resource
if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and os.environ.get("NEURONTRAIN_TEST_RECORD"):
    keys = ("RANK", "GROUP_RANK", "MASTER_ADDR", "NEURON_RT_ROOT_COMM_ID", "SLURMD_NODENAME", "SLURM_NODEID",
            "NEURONTRAIN_CACHE_DIR")
    record = {k: os.environ.get(k) for k in keys}
    record["nofile"] = resource.getrlimit(resource.RLIMIT_NOFILE)  # (soft, hard)
    path = os.path.join(os.environ["NEURONTRAIN_TEST_RECORD"], f"worker-{os.getpid()}.json")
    with open(path, "w") as fh:
        json.dump(record, fh)
"""


@pytest.fixture(scope="module")
def llama_two_workers(tmp_path_factory) -> Path:
    """The 2-worker tiny-Llama run the other tests compare against. Where a real Slurm can be started here
    (root and slurm-wlm, as in CI), the run is the job of the sbatch script `submit slurm` writes, on a Slurm
    cluster of two nodes (one worker each); every worker records the environment it sees. Elsewhere the same run
    is started directly."""
    import slurm_cluster

    root = tmp_path_factory.mktemp("dp")
    out = root / "two"
    if slurm_cluster.available() is not None:
        result = run_cli("run", LLAMA, "-o", str(out), "--nproc-per-node", "2", *LLAMA_ARGS)
        assert result.returncode == 0, result.stderr[-3000:]
        return out
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(RECORDER)
    (root / "workers").mkdir()
    reserved = Path("/proc/sys/net/ipv4/ip_local_reserved_ports")
    reserved_before = reserved.read_text()
    cluster = slurm_cluster.SlurmCluster(root / "slurm", NODES).start()
    try:
        env = {**cluster.env, "PYTHONPATH": str(root / "site"), "NEURONTRAIN_TEST_RECORD": str(root / "workers")}
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))  # the job inherits it: the script raises it
        try:
            result = run_cli(
                "submit",
                "slurm",
                LLAMA,
                "--nodes",
                "2",
                "--nproc-per-node",
                "1",
                "--backend",
                "xla-cpu",
                "-o",
                str(out),
                "--master-port",
                str(_free_port()),
                "--max-restarts",
                "0",
                "--submit",
                "--job-name",
                "llama-dp",
                "--node-cache-dir",
                str(root / "node-cache"),
                *LLAMA_ARGS,
                env=env,
                timeout=120,
            )
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert result.returncode == 0, result.stderr
        submitted = json.loads(result.stdout)
        state = cluster.wait(submitted["job_id"], timeout=400)
        logs = sorted(Path(submitted["node_logs"]).glob("node-*.log"))
        assert state == "COMPLETED", "\n".join(p.read_text()[-3000:] for p in logs) or state
        (root / "slurm-job.json").write_text(
            json.dumps({**submitted, "state": state, "reserved_ports": reserved.read_text().strip()})
        )
    finally:
        cluster.stop()
        reserved.write_text(reserved_before.strip() or "\n")  # the job reserved the root-comm port: undo
    return out


def test_two_llama_workers_match_one_worker_with_the_same_global_batch(llama_two_workers, tmp_path):
    one = tmp_path / "one"
    result = run_cli("run", LLAMA, "-o", str(one), "--no-preflight", "--set", "data.batch_size=16", *LLAMA_ARGS)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_curves_match(one, llama_two_workers, 16)
    two = read_json(llama_two_workers / "summary.json")
    assert (two["world_size"], two["per_worker_batch"], two["effective_batch"]) == (2, 8, 16)
    assert read_json(one / "summary.json")["effective_batch"] == 16
    assert two["unexpected_graphs"] == 0 and two["restarts"] == 0
    # 16 steps of one bucket: the workers compared shapes where the plan introduces a graph only, not each step
    assert two["rank_checks"] == {"exchanges": 2, "at": ["step-1", "eval-batch-0"]}
    assert abs(two["eval_loss"] - read_json(one / "summary.json")["eval_loss"]) < 1e-3 * two["eval_loss"]
    preflight = read_metrics(llama_two_workers / "preflight.jsonl")
    assert len(preflight) == 1 and [r["rank"] for r in preflight[0]["ranks"]] == [0, 1]
    assert {c["check"] for c in preflight[0]["ranks"][1]["checks"]} >= {"device matmul", "all_reduce", "all_gather"}


def _bert_args(packing: str) -> list[str]:
    # Dropout off: a mask drawn per worker cannot equal a mask drawn for the whole batch. Packed: each worker
    # takes 8 of the 16 rows, and the loss is the mean over the documents of all of them.
    sets = [f"data.packing={packing}", "train.max_steps=12", "train.log_every=1", "checkpoint.every=0",
            "data.buckets=[32,64,128]", "model.config.hidden_dropout_prob=0",
            "model.config.attention_probs_dropout_prob=0"]  # fmt: skip
    return ["--no-preflight", *(x for value in sets for x in ("--set", value))]


def _two_workers(packing: str) -> list[str]:
    return ["--set", "data.batch_size=8", *_bert_args(packing)]


@pytest.fixture(scope="module")
def bert_two_workers(tmp_path_factory) -> Path:
    """The 2-worker tiny-BERT run (buckets 32/64/128, no packing) that the one-worker run and the served run
    compare against."""
    two = tmp_path_factory.mktemp("bert") / "two"
    result = run_cli(
        "run", BERT, "-o", str(two), "--nproc-per-node", "2", "--set", "data.batch_size=8", *_bert_args("off")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return two


@pytest.mark.parametrize("packing", ["off", "on"])
def test_two_bert_workers_match_one_worker(tmp_path, packing, request):
    one = tmp_path / "one"
    r1 = run_cli("run", BERT, "-o", str(one), "--set", "data.batch_size=16", *_bert_args(packing))
    assert r1.returncode == 0, r1.stderr[-3000:]
    if packing == "off":
        two = request.getfixturevalue("bert_two_workers")
    else:
        two = tmp_path / "two"
        r2 = run_cli(
            "run", BERT, "-o", str(two), "--nproc-per-node", "2", "--set", "data.batch_size=8", *_bert_args(packing)
        )
        assert r2.returncode == 0, r2.stderr[-3000:]
    _assert_curves_match(one, two, 12)
    s1, s2 = read_json(one / "summary.json"), read_json(two / "summary.json")
    assert abs(s1["eval_loss"] - s2["eval_loss"]) < 1e-3 * s1["eval_loss"]
    assert s1["eval_accuracy"] == s2["eval_accuracy"]


def test_killed_worker_is_restarted_and_resumes_to_the_same_weights(llama_two_workers, tmp_path, capsys):
    out = tmp_path / "killed"
    args = ["run", LLAMA, "-o", str(out), "--nproc-per-node", "2", "--max-restarts", "1", *LLAMA_ARGS]
    code, stderr = run_killing_a_worker(args, out, 4)
    assert code == 0, stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["restarts"] == 1 and summary["resumed_from_step"] in (4, 8, 12)
    assert sorted(_losses(out)) == list(range(1, 17))  # steps after the checkpoint were logged again, once
    preflight = read_metrics(out / "preflight.jsonl")
    assert [p["restart"] for p in preflight] == [0, 1] and all(p["ok"] for p in preflight)
    code, stdout, stderr = cli_in_process(
        capsys, "checkpoint", "verify", str(llama_two_workers / "model"), str(out / "model")
    )
    assert code == 0 and "EQUAL" in stdout, stdout + stderr


@pytest.mark.parametrize(
    "args, code, message",
    [
        (
            ["--nproc-per-node", "2", "--set", "train.global_batch_size=24"],
            2,
            "train.global_batch_size 24 is not divisible by data.batch_size 8 x 2 workers = 16",
        ),
        (
            ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "no-such-host.invalid"],
            2,
            "cannot resolve the master address",
        ),
        (
            ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-port", "1", "--rdzv-timeout", "1"],
            1,
            "rendezvous at 127.0.0.1:1",
        ),
    ],
)
def test_bad_combinations_exit_with_one_line(tmp_path, args, code, message):
    t0 = time.time()
    result = run_cli("run", LLAMA, "-o", str(tmp_path / "out"), *args, timeout=120)
    assert result.returncode == code, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("neurontrain: error:") and message in last, last
    assert "Traceback" not in result.stderr
    assert time.time() - t0 < 90


def test_failing_worker_preflight_exits_3_naming_the_rank(tmp_path):
    result = run_cli(
        "run",
        LLAMA,
        "-o",
        str(tmp_path / "out"),
        "--nproc-per-node",
        "2",
        "--set",
        "runtime.expected_devices=4",
        timeout=180,
    )
    assert result.returncode == 3, result.stderr[-2000:]
    assert "preflight failed on xla-cpu, rank 0" in result.stderr and "device count" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("neurontrain: error: worker rank")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_diverging_rank_is_named_with_its_shapes_before_a_collective_hangs(tmp_path):
    """Rank 1's batches take another bucket (a test hook cuts them): both workers name it at the first step, long
    before the 600 s a collective would wait."""
    args = ["run", LLAMA, "-o", str(tmp_path / "out"), "--nproc-per-node", "2", "--no-preflight"]
    args += ["--set", "train.max_steps=2", "--set", "train.schedule.warmup_steps=1", "--set", "data.buckets=[128]"]
    args += ["--set", "data.packing=off"]  # batches of data.batch_size samples, the shapes named below
    result = run_cli(*args, "--set", "runtime.collective_timeout=600", env=diverging_rank1(tmp_path / "site"))
    ended = time.time()
    assert result.returncode == 1, result.stderr[-3000:]
    named = "workers diverge at step 1 (train): rank 1 has input_ids [8, 64], where the plan has [8, 128] (as ranks 0)"
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("neurontrain: error: worker rank")
    assert ended - float((tmp_path / "site" / "diverged_at").read_text()) < 30


def test_generated_sbatch_ran_on_a_real_slurm(llama_two_workers):
    import slurm_cluster

    why = slurm_cluster.available()
    if why:
        pytest.skip(why)
    job = read_json(llama_two_workers.parent / "slurm-job.json")
    assert job["state"] == "COMPLETED" and Path(job["script"]).name == "llama-dp.sbatch"
    node0 = (Path(job["node_logs"]) / "node-0.log").read_text()
    assert "2 workers x batch 8" in node0 and "preflight ok" in node0
    assert (Path(job["node_logs"]) / "node-1.log").exists()  # a log per node
    assert "41000" in job["reserved_ports"].split(",")  # the root-comm port left the ephemeral range
    summary = read_json(llama_two_workers / "summary.json")
    assert summary["world_size"] == 2 and summary["steps"] == 16
    assert (llama_two_workers / "checkpoints" / "step_00000016" / "COMPLETE").exists()


def test_workers_see_the_root_comm_address_of_rank_0s_host(llama_two_workers):
    """Each worker's own record: rank 0 runs on the job's first host, and every worker's NEURON_RT_ROOT_COMM_ID
    and MASTER_ADDR name that host's address, although sorting the addresses would put the other node first."""
    import slurm_cluster

    why = slurm_cluster.available()
    if why:
        pytest.skip(why)
    records = [read_json(p) for p in (llama_two_workers.parent / "workers").glob("worker-*.json")]
    assert sorted(int(r["RANK"]) for r in records) == [0, 1]
    assert sorted(NODES.values())[0] != NODES["nodea"]  # the test's premise (string order, as c10d sorts)
    rank0 = next(r for r in records if r["RANK"] == "0")
    assert rank0["SLURMD_NODENAME"] == "nodea" and rank0["SLURM_NODEID"] == "0"
    assert {r["SLURMD_NODENAME"] for r in records} == set(NODES)
    for r in records:
        assert r["NEURON_RT_ROOT_COMM_ID"] == f"{NODES[rank0['SLURMD_NODENAME']]}:41000", r
        assert r["MASTER_ADDR"] == NODES[rank0["SLURMD_NODENAME"]], r
        soft, hard = r["nofile"]
        assert r["GROUP_RANK"] == r["SLURM_NODEID"] and soft >= min(65535, hard), r  # raised as far as allowed
        assert r["NEURONTRAIN_CACHE_DIR"] == str(llama_two_workers.parent / "node-cache")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- heterogeneous: the same runs with their batches made on a Ray data node ------------------------------------
# The served run joins a loopback Ray cluster (`ray_cluster`) through RAY_ADDRESS: starting one per run cost
# about half a minute each on 2 cores.
RAY = ["--launcher", "ray", "--set", "data.service.kind=ray"]
# Ray Train's own actors and their calls (the worker group, its controller and helpers); anything else on the
# trainium node would be Ray Data's
RAY_TRAIN = tuple(
    f"{kind} {name}"
    for kind in ("actor", "task")
    for name in ("RayTrainWorker", "execute.", "PreemptionWatcher", "TrainController", "SynchronizationActor",
                 "PlacementGroupCleaner")
)  # fmt: skip


class SharedCluster:
    """The module's loopback Ray cluster, and what had run on it before the latest served run (the runs'
    placement.json counts every task and actor the cluster ever ran)."""

    def __init__(self, address: str) -> None:
        self.address, self.seen = address, {}

    def env(self) -> dict[str, str]:
        return {"RAY_ADDRESS": self.address}

    def placement_of_the_latest_run(self, run: Path) -> dict[str, dict[str, int]]:
        """The run's placement.json less what earlier runs had placed: {node role: {"kind name": count}}."""
        total = read_json(run / "data_service" / "placement.json")
        seen, self.seen = self.seen, total
        return {
            role: {name: n - seen.get(role, {}).get(name, 0) for name, n in counts.items()}
            for role, counts in total.items()
        }


@pytest.fixture(scope="module")
def ray_cluster():
    """One loopback Ray cluster for the served runs: a data node and a trainium node for 2 workers, started by
    the code `run --local-cluster data=1,trainium=1` starts its cluster with (parsing and sizing of the flag are
    unit-tested)."""
    from neurontrain.launch.ray_cluster import _start_local
    from neurontrain.recipe import DataServiceSpec

    cluster = _start_local(DataServiceSpec(kind="ray"), {"data": 1, "trainium": 1}, world=2)
    try:
        yield SharedCluster(cluster.address)
    finally:
        cluster.shutdown()


def _sets(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--set"]


def _assert_served_in_lockstep(
    run: Path, recipe: str, args: list[str], start: int, steps: int, cluster: SharedCluster
) -> list[int]:
    """Both workers received the planned bucket at every position from `start`, every batch from the data
    node, and no Ray Data task or actor of this run ran on the trainium node. Returns the planned lengths."""
    plan = make_plan(load_recipe(recipe, _sets(args)), "xla-cpu", world=2)
    planned = plan.batcher.used_lengths(steps - start, start)
    for rank in (0, 1):
        record = read_json(run / "data_service" / f"rank_{rank}.json")
        assert [tuple(x) for x in record["received"]] == list(enumerate(planned, start=start))
        assert all(node.startswith("data@") for node in record["produced_on"]), record["produced_on"]
        assert sum(record["produced_on"].values()) == steps - start
    placement = {
        role: {k: n for k, n in ran.items() if n > 0} for role, ran in cluster.placement_of_the_latest_run(run).items()
    }
    trainium = sorted(placement["trainium"])
    assert trainium and all(name.startswith(RAY_TRAIN) for name in trainium), trainium
    assert any("CollateWorkerRows" in name for name in placement["data"]), placement["data"]
    assert any(name.startswith("task ReadRange") for name in placement["data"]), placement["data"]
    return planned


def _assert_same_curve(served: Path, reference: Path, steps: int) -> None:
    a, b = _losses(served), _losses(reference)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in b)
    assert worst <= 1e-6, f"the served run's loss differs from the torchrun run's by {worst:.2e} relative"


def test_served_bert_worker_killed_resumes_in_lockstep_like_torchrun_with_every_batch_from_the_data_node(
    bert_two_workers, ray_cluster, tmp_path
):
    """One served run carries both checks (each served run costs about a minute on 2 cores): the batches of
    several buckets come from the data node in lockstep, and a Ray Train worker killed after a checkpoint is
    restarted (its preflight again) and resumes at the checkpoint's data position, ending on torchrun's curve."""
    served = tmp_path / "served"
    args = [*_two_workers("off"), "--set", "checkpoint.every=4"]
    args = [a for a in args if a != "--no-preflight"]  # the preflight runs again on the restart
    last_worker = lambda: (ray_train_worker_pids() or [None])[-1]  # noqa: E731
    cli = ["run", BERT, "-o", str(served), "--nproc-per-node", "2", "--max-restarts", "1", *args, *RAY]
    code, stderr = run_killing_a_worker(cli, served, 4, find_pid=last_worker, env=ray_cluster.env())
    assert code == 0, stderr[-3000:]
    summary = read_json(served / "summary.json")
    assert summary["world_size"] == 2 and summary["restarts"] == 1 and summary["resumed_from_step"] in (4, 8)
    assert summary["unexpected_graphs"] == 0 and summary["compilations"] <= summary["expected_graphs"]
    assert set(summary["buckets_used"]) <= {32, 64, 128}
    preflight = read_metrics(served / "preflight.jsonl")
    assert [p["restart"] for p in preflight] == [0, 1] and all(p["ok"] for p in preflight)
    # the restarted streams began at the checkpoint's data position (one micro-batch a step)
    planned = _assert_served_in_lockstep(served, BERT, args, summary["resumed_from_step"], 12, ray_cluster)
    assert len(set(planned)) > 1  # several buckets: lockstep is not trivially true
    _assert_same_curve(served, bert_two_workers, 12)
    assert summary["eval_accuracy"] == read_json(bert_two_workers / "summary.json")["eval_accuracy"]
