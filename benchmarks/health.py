"""Health-check figures on this machine: preflight wall seconds for 2 workers, and the collectives' bus
bandwidth per operation and size (gloo between torchrun workers on XLA:CPU). Prints one JSON object.

    python benchmarks/health.py [--rounds 2] [--sizes 1K,64K,1M,16M]

Preflight = `neurontrain health --nproc-per-node 2` with its default checks (device sanity on every worker,
all-reduce / all-gather / reduce-scatter at 1 KiB, 64 KiB, 1 MiB), timed from the command's start to its
exit, in a fresh process each round (so interpreter, torch and torch-xla start-up are included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def health(args: list[str]) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "neurontrain",
                "health",
                "--nproc-per-node",
                "2",
                "--json",
                f"{tmp}/out.json",
                *args,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            raise SystemExit(f"health failed: {res.stderr[-2000:]}")
        return wall, json.loads(Path(f"{tmp}/out.json").read_text())


def phases(out: dict, wall: float) -> dict:
    """Where a preflight's time goes (slowest worker): start-up, device checks, rendezvous, collectives."""
    t0 = out["started_at"]
    ranks = out["ranks"].values()

    def last(pred) -> float:
        return max(r["finished_at"] for rank in ranks for r in rank["results"] if pred(r["check"]))

    ready = max(rank["started_at"] for rank in ranks)
    rendezvous = last(lambda c: c == "rendezvous")
    collectives = last(lambda c: c.split()[0] in ("all_reduce", "all_gather", "reduce_scatter"))
    device = max(c["finished_at"] for c in out["node_device"]["results"])
    return {
        "launch_to_workers_running": round(ready - t0, 2),
        "workers_running_to_rendezvous": round(rendezvous - ready, 2),
        "collectives": round(collectives - rendezvous, 2),
        "device_checks_from_launch_incl_torch_xla_import": round(device - t0, 2),
        "command_total": round(wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sizes", default="1K,64K,1M,16M")
    args = parser.parse_args()
    runs = [health([]) for _ in range(args.rounds)]
    walls = [w for w, _ in runs]
    _, sweep = health(["--sizes", args.sizes, "--iters", "10"])
    print(
        json.dumps(
            {
                "preflight_2_workers_wall_seconds": [round(w, 2) for w in walls],
                "preflight_median_seconds": round(statistics.median(walls), 2),
                "target_seconds": 15,
                "phases_seconds": phases(runs[-1][1], runs[-1][0]),
                "collectives": [
                    {k: c[k] for k in ("op", "size_bytes", "time_us", "algbw_gibps", "busbw_gibps")}
                    for c in sweep["collectives"]
                ],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
