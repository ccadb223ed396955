"""`run --launcher ray` with data.service.kind ray on a loopback Ray cluster of a data node and a trainium node
(`--local-cluster data=1,trainium=1`), 2 workers, against `run --nproc-per-node 2` on the same plan."""

from pathlib import Path

from conftest import RECIPES, ray_train_worker_pids, read_json, read_metrics, run_cli, run_killing_a_worker

from neurontrain.loop.planning import make_plan
from neurontrain.recipe import load_recipe

BUCKETS = ["--set", "data.buckets=[32,64,128]", "--set", "train.log_every=1"]
BERT = [str(RECIPES / "tiny-bert-classification.yaml"), "--set", "train.max_steps=12", *BUCKETS]
LLAMA = [
    str(RECIPES / "tiny-llama-clm.yaml"),
    *("--set", "train.max_steps=12", "--set", "checkpoint.every=4"),
    *BUCKETS,
]
RAY = ["--launcher", "ray", "--local-cluster", "data=1,trainium=1", "--set", "data.service.kind=ray"]
# Ray Train's own actors and their calls (the worker group, its controller and helpers); anything else on the
# trainium node would be Ray Data's
RAY_TRAIN = tuple(
    f"{kind} {name}"
    for kind in ("actor", "task")
    for name in ("RayTrainWorker", "execute.", "PreemptionWatcher", "TrainController", "SynchronizationActor",
                 "PlacementGroupCleaner")
)  # fmt: skip


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def _assert_same_curve(ray_run: Path, reference: Path, steps: int) -> None:
    a, b = _losses(ray_run), _losses(reference)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in b)
    assert worst <= 1e-6, f"the served run's loss differs from the torchrun run's by {worst:.2e} relative"


def _planned_lengths(args: list[str], start: int, count: int) -> list[int]:
    overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    plan = make_plan(load_recipe(args[0], overrides), "xla-cpu", world=2)
    return plan.batcher.used_lengths(count, start)


def _assert_served_in_lockstep(run: Path, args: list[str], start: int, steps: int) -> None:
    """Both workers received the planned bucket at every position from `start`, every batch from the data
    node, and no Ray Data task or actor ran on the trainium node."""
    records = [read_json(run / "data_service" / f"rank_{r}.json") for r in (0, 1)]
    planned = _planned_lengths(args, start, steps - start)
    assert len(set(planned)) > 1  # the plan has several buckets, so lockstep is not trivially true
    for record in records:
        assert [tuple(x) for x in record["received"]] == list(enumerate(planned, start=start))
        assert all(node.startswith("data@") for node in record["produced_on"]), record["produced_on"]
        assert sum(record["produced_on"].values()) == steps - start
    placement = read_json(run / "data_service" / "placement.json")
    trainium = sorted(placement["trainium"])
    assert trainium and all(name.startswith(RAY_TRAIN) for name in trainium), trainium
    assert any("CollateWorkerRows" in name for name in placement["data"]), placement["data"]
    assert any(name.startswith("task ReadRange") for name in placement["data"]), placement["data"]


def test_served_bert_matches_torchrun_with_the_planned_graphs_on_the_data_node(tmp_path):
    reference, served = tmp_path / "torchrun", tmp_path / "ray"
    result = run_cli("run", *BERT, "-o", str(reference), "--nproc-per-node", "2", "--no-preflight", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli("run", *BERT, "-o", str(served), "--nproc-per-node", "2", *RAY, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(served / "summary.json")
    assert summary["world_size"] == 2 and summary["restarts"] == 0
    assert summary["compilations"] == summary["expected_graphs"] and summary["unexpected_graphs"] == 0
    assert set(summary["buckets_used"]) <= {32, 64, 128}
    _assert_served_in_lockstep(served, BERT, 0, 12)
    _assert_same_curve(served, reference, 12)
    assert read_json(served / "summary.json")["eval_accuracy"] == read_json(reference / "summary.json")["eval_accuracy"]


def test_served_llama_worker_killed_resumes_at_the_checkpoints_position(tmp_path):
    reference, served = tmp_path / "torchrun", tmp_path / "ray"
    result = run_cli("run", *LLAMA, "-o", str(reference), "--nproc-per-node", "2", "--no-preflight", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    args = ["run", *LLAMA, "-o", str(served), "--nproc-per-node", "2", "--max-restarts", "1", *RAY]
    code, stderr = run_killing_a_worker(args, served, 4, find_pid=lambda: (ray_train_worker_pids() or [None])[-1])
    assert code == 0, stderr[-3000:]
    summary = read_json(served / "summary.json")
    assert summary["restarts"] == 1 and summary["resumed_from_step"] in (4, 8)
    assert summary["unexpected_graphs"] == 0 and summary["compilations"] <= summary["expected_graphs"]
    preflight = read_metrics(served / "preflight.jsonl")
    assert [p["restart"] for p in preflight] == [0, 1] and all(p["ok"] for p in preflight)
    # the restarted streams began at the checkpoint's data position (one micro-batch a step)
    _assert_served_in_lockstep(served, LLAMA, summary["resumed_from_step"], 12)
    _assert_same_curve(served, reference, 12)
