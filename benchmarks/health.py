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
        res = subprocess.run([sys.executable, "-m", "neurontrain", "health", "--nproc-per-node", "2", "--json",
                              f"{tmp}/out.json", *args], cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            raise SystemExit(f"health failed: {res.stderr[-2000:]}")
        return wall, json.loads(Path(f"{tmp}/out.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sizes", default="1K,64K,1M,16M")
    args = parser.parse_args()
    walls = [health([])[0] for _ in range(args.rounds)]
    _, sweep = health(["--sizes", args.sizes, "--iters", "10"])
    print(json.dumps({
        "preflight_2_workers_wall_seconds": [round(w, 2) for w in walls],
        "preflight_median_seconds": round(statistics.median(walls), 2),
        "target_seconds": 15,
        "collectives": [{k: c[k] for k in ("op", "size_bytes", "time_us", "algbw_gibps", "busbw_gibps")}
                        for c in sweep["collectives"]],
    }, indent=2))


if __name__ == "__main__":
    main()
