"""The Ray data service against loading in the training process, on one machine. Prints one JSON object.

    python benchmarks/data_service.py [--batches 200] [--rounds 3] [--train-steps 30] [--train-rounds 1]

Batches are tiny-llama-clm's (batch 8 a worker, 2 workers, buckets 32/64/128), worker 0's rows of each global
batch, on a loopback cluster of a data node and a trainium node (`--local-cluster data=1,trainium=1`). Per round
(the contenders alternate; medians reported):

- `in_process`: the toolkit's own collation in this process (what a torchrun worker does), batches/s;
- `dataloader_1_worker`: the same collation in a torch DataLoader with one worker process, batches/s;
- `service`: the stream a training worker reads (`RayBatchSource`), consumed by a task on the trainium node:
  `first_batch_seconds` (the pipeline's start on the data node to the first batch) and batches/s after it.

`cluster_start_seconds`: the loopback cluster's start and join. Training (`--train-rounds`, 0 to skip): the
same recipe for --train-steps steps, `run --nproc-per-node 2` against `run --launcher ray` with the service,
each a fresh process; steps/s from the trainer's own wall time (summary.json: compiles included) and the run's
wall time (cluster start and tokenizing on the data node included for the service), and the steady state: the
median tokens/s of the logged windows after the first third of the steps (metrics.jsonl).

What 2 cores can show: the data node, the trainium node and the driver share the same two cores, so the service
cannot take work off the training cores here; it shows what the service costs (start-up, transfer) and that it
keeps up, not the speed-up of moving tokenizing and collation to other hosts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-llama-clm.yaml"
OVERRIDES = ["data.buckets=[32,64,128]", "data.train_samples=1500"]


def _plan(world: int = 2):
    from neurontrain.plan.planning import make_plan
    from neurontrain.recipe import load_recipe

    return make_plan(load_recipe(str(RECIPE), OVERRIDES), "xla-cpu", world=world)


def in_process(plan, batches: int) -> float:
    collate = plan.collator("train", 0)
    start = time.perf_counter()
    for batch in itertools.islice(plan.batcher.iterate(0), batches):
        collate(batch)
    return batches / (time.perf_counter() - start)


def dataloader(plan, batches: int) -> float:
    import torch.utils.data

    order = list(itertools.islice(plan.batcher.iterate(0), batches))
    loader = torch.utils.data.DataLoader(order, batch_size=None, num_workers=1, collate_fn=plan.collator("train", 0))
    start = time.perf_counter()
    for _ in loader:
        pass
    return batches / (time.perf_counter() - start)


def _consume(source, batches: int) -> tuple[float, float]:
    start = time.perf_counter()
    stream = iter(source(0, batches))
    next(stream)
    first = time.perf_counter() - start
    for _ in stream:
        pass
    return first, (batches - 1) / (time.perf_counter() - start - first)


def service(served, collation, batches: int) -> tuple[float, float]:
    import ray

    task = ray.remote(_consume).options(label_selector={"neurontrain-role": "trainium"}, num_cpus=1)
    return ray.get(task.remote(served.source_for(collation), batches))


def deliver(batches: int, rounds: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from neurontrain.data.ray_service import prepare_on_data_nodes
    from neurontrain.recipe import load_recipe

    start = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "labels": {"neurontrain-role": "data"}})
    cluster.add_node(num_cpus=2, labels={"neurontrain-role": "trainium"})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR")
    cluster_start = time.perf_counter() - start
    try:
        plan = _plan()
        served = prepare_on_data_nodes(load_recipe(str(RECIPE), [*OVERRIDES, "data.service.kind=ray"]))
        results: dict[str, list] = {"in_process": [], "dataloader_1_worker": [], "service": [], "first": []}
        for _ in range(rounds):
            results["in_process"].append(in_process(plan, batches))
            results["dataloader_1_worker"].append(dataloader(plan, batches))
            first, rate = service(served, plan.collation(0), batches)
            results["service"].append(rate)
            results["first"].append(first)
    finally:
        ray.shutdown()
        cluster.shutdown()
    med = {k: statistics.median(v) for k, v in results.items()}
    return {
        "cluster_start_seconds": round(cluster_start, 2),
        "batches": batches,
        "batches_per_second": {k: round(med[k], 1) for k in ("in_process", "dataloader_1_worker", "service")},
        "service_first_batch_seconds": round(med["first"], 2),
        "service_vs_in_process": round(med["service"] / med["in_process"], 3),
        "service_vs_dataloader_1_worker": round(med["service"] / med["dataloader_1_worker"], 3),
        "rounds": {k: [round(x, 2) for x in v] for k, v in results.items()},
    }


def train_once(served: bool, steps: int, out: Path) -> dict:
    args = ["--nproc-per-node", "2", "--no-preflight"]
    if served:
        args += ["--launcher", "ray", "--local-cluster", "data=1,trainium=1", "--set", "data.service.kind=ray"]
    sets = [x for o in [*OVERRIDES, f"train.max_steps={steps}"] for x in ("--set", o)]
    argv = [sys.executable, "-m", "neurontrain", "run", str(RECIPE), "-o", str(out), *sets, *args]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"run failed: {done.stderr.strip().splitlines()[-1]}")
    summary = json.loads((out / "summary.json").read_text())
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = [r["tokens_per_second"] for r in logged if "tokens_per_second" in r and r["step"] > steps // 3]
    return {
        "trainer_steps_per_second": steps / summary["wall_seconds"],
        "run_steps_per_second": steps / wall,
        "steady_tokens_per_second": statistics.median(steady),
    }


def train(steps: int, rounds: int) -> dict:
    runs: dict[str, list[dict]] = {"torchrun": [], "service": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = ("torchrun", "service") if r % 2 == 0 else ("service", "torchrun")
            for name in order:
                runs[name].append(train_once(name == "service", steps, Path(tmp) / f"{name}{r}"))
    out = {}
    for name, rows in runs.items():
        out[name] = {key: round(statistics.median(row[key] for row in rows), 3) for key in rows[0]}
    for key in ("trainer_steps_per_second", "steady_tokens_per_second"):
        out[f"service_vs_torchrun_{key}"] = round(out["service"][key] / out["torchrun"][key], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--train-rounds", type=int, default=1)
    args = parser.parse_args(argv)
    result = {"delivery": deliver(args.batches, args.rounds)}
    if args.train_rounds:
        result["training"] = train(args.train_steps, args.train_rounds)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
