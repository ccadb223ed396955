"""Plain Lightning (a bare accelerator shim) vs neurontrain.lightning on the same unchanged module and loaders
(`examples/lightning_tiny.py`: dynamic padding, accumulation 2, clipping, an LR schedule, `prog_bar` logging,
validation, ModelCheckpoint), each in fresh processes on XLA:CPU. Prints one JSON object.

    python benchmarks/lightning_graphs.py [--steps 4] [--rounds 3]

Per contender and round (the contenders alternate; medians reported): `graphs` (XLA compiles from the start of
the fit to the end of training), `host_reads_per_step` (device->host transfers in that span, per optimizer step)
and `seconds` (the process's wall time: imports, data, compiles, the steps). Ratios are plain over neurontrain.

Plain Lightning compiles a graph per distinct batch length and per fused validation run, and XLA:CPU maps code
pages for each compiled kernel: here it passed the kernel's `vm.max_map_count` (65530) before 40 steps and a
10-step run ended in a segmentation fault, so the default is a short run both contenders finish.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "lightning_tiny.py"
CONTENDERS = {"plain": ["--plain"], "neurontrain": ["--no-preflight"]}


def run_once(name: str, steps: int, out: Path) -> dict:
    """One fresh process of the example; its graphs, reads per step and wall seconds."""
    argv = [sys.executable, str(SCRIPT), "--max-steps", str(steps), "--output-dir", str(out), *CONTENDERS[name]]
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    if name == "plain":
        summary = json.loads((out / "plain_summary.json").read_text())
        return {"graphs": summary["graphs"], "host_reads_per_step": summary["host_reads_per_step"], "seconds": seconds}
    summary = json.loads((out / "summary.json").read_text())
    return {
        "graphs": summary["compilations"],
        "host_reads_per_step": summary["host_reads_per_step"],
        "seconds": seconds,
        "unexpected_graphs": summary["unexpected_graphs"],
        "hidden_host_syncs": len(summary["hidden_host_syncs"]),
    }


def medians(rows: list[dict]) -> dict:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rows: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = list(CONTENDERS) if round_ % 2 == 0 else list(reversed(CONTENDERS))
            for name in order:
                rows[name].append(run_once(name, args.steps, Path(tmp) / f"{name}-{round_}"))
                print(f"round {round_ + 1} {name}: {rows[name][-1]}", file=sys.stderr, flush=True)
    result = {name: medians(found) for name, found in rows.items()}
    plain, ours = result["plain"], result["neurontrain"]
    result["plain_over_neurontrain"] = {
        key: round(plain[key] / ours[key], 2) if ours[key] else None
        for key in ("graphs", "host_reads_per_step", "seconds")
    }
    result["steps"], result["rounds"] = args.steps, args.rounds
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
