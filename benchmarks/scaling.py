"""Data-parallel scaling on this machine: `neurontrain run` with 1 worker and with 2 torchrun workers, the same
per-worker batch (so 2 workers train twice the tokens a step). Prints one JSON object.

    python benchmarks/scaling.py [--recipe recipes/tiny-llama-clm.yaml] [--steps 80] [--rounds 2]

tokens/s is the steady state: the median of the logged intervals after the first two (compiles), over all
workers. scaling efficiency = tokens/s(2 workers) / (2 x tokens/s(1 worker)). On XLA:CPU one worker already
uses every core (XLA's own thread pool), so on a 2-core machine the ideal is well below 1: the figure measures
what the gloo all-reduce and the host round trip of the gradients cost, not added hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(recipe: Path, workers: int, steps: int, log_every: int, out: Path) -> dict:
    sets = [
        f"train.max_steps={steps}",
        f"train.log_every={log_every}",
        "checkpoint.every=0",
        "checkpoint.save_final=false",
        "train.eval_at_end=false",
        "data.buckets=[128]",
    ]
    cmd = [sys.executable, "-m", "neurontrain", "run", str(recipe), "-o", str(out), "--no-preflight"]
    cmd += [a for s in sets for a in ("--set", s)]
    if workers > 1:
        cmd += ["--nproc-per-node", str(workers)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        raise SystemExit(f"run with {workers} workers failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    intervals = [r["tokens_per_second"] for r in records if "loss" in r and r["step"] > 2 * log_every]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "steady_tokens_per_second": statistics.median(intervals),
        "whole_run_tokens_per_second": summary["tokens_per_second"],
        "wall_seconds": summary["wall_seconds"],
        "effective_batch": summary["effective_batch"],
        "final_loss": summary["final_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny-llama-clm.yaml"))
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):  # alternate, so machine noise hits both
            for workers in (1, 2):
                results[workers].append(
                    run(Path(args.recipe), workers, args.steps, args.log_every, Path(tmp) / f"w{workers}-{i}")
                )
    tps = {w: statistics.median(r["steady_tokens_per_second"] for r in rs) for w, rs in results.items()}
    print(
        json.dumps(
            {
                "recipe": Path(args.recipe).name,
                "steps": args.steps,
                "cores": os.cpu_count(),
                "tokens_per_second_1_worker": round(tps[1], 1),
                "tokens_per_second_2_workers": round(tps[2], 1),
                "speedup": round(tps[2] / tps[1], 3),
                "scaling_efficiency": round(tps[2] / (2 * tps[1]), 3),
                "rounds": {str(w): rs for w, rs in results.items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
