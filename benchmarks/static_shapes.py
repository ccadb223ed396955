"""Dynamic padding vs pad-to-max vs fixed buckets vs auto buckets vs packed rows, on the same data and
model, through `neurontrain run` on the embedded backend (XLA:CPU). Prints one JSON object.

    python benchmarks/static_shapes.py [--short-steps 40] [--long-steps 400] [--rounds 2]

Each strategy runs in a fresh process, so every run pays its own compiles (XLA:CPU cannot reload
compiled executables across processes). wall_seconds is the training loop including compiles, as
reported in summary.json; tokens_per_second counts real (non-pad) tokens over that time. The static
strategies run --rounds times, in alternating order, and the medians are reported; dynamic padding (ten
times slower) runs once, on the short run only unless --long-dynamic.

Packed rows hold more samples than a row of one sample, so in the same number of steps a packed run
trains on more data: compare real tokens a second, not wall seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-bert-classification.yaml"
# lengths up to 256 tokens, lognormal (median ~30): the shape of real review data
COMMON = [
    "--set",
    "data.max_length=256",
    "--set",
    "model.config.max_position_embeddings=256",
    "--set",
    "data.train_samples=4000",
    "--set",
    "data.batch_size=16",
    "--set",
    "data.eval_samples=0",
    "--set",
    "checkpoint.every=0",
    "--set",
    "checkpoint.save_final=false",
    "--set",
    "train.log_every=1000",
    "--set",
    "train.schedule.warmup_steps=0",
    # keeps 1 - lr * weight_decay off fp32 1.0 at the last steps (a graph of its own on XLA; see README)
    "--set",
    "train.schedule.min_lr_ratio=0.1",
]
STRATEGIES = {
    "dynamic": "dynamic",
    "pad_to_max": "max",
    "buckets": "[32,64,128,256]",
    "auto": "auto",
    "packed": "auto",
}
PACKED = {"packed"}


def run(strategy: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "neurontrain",
            "run",
            str(RECIPE),
            "--output-dir",
            tmp,
            *COMMON,
            "--set",
            f"train.max_steps={steps}",
            "--set",
            f"data.buckets={STRATEGIES[strategy]}",
            "--set",
            f"data.packing={'on' if strategy in PACKED else 'off'}",
        ]
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"{strategy} failed: {result.stderr[-2000:]}")
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    return {
        "compilations": summary["compilations"],
        "wall_seconds": round(summary["wall_seconds"], 2),
        "tokens_per_second": round(summary["tokens_per_second"], 1),
        "padding_fraction": round(summary["padding_fraction"], 4),
        "buckets_used": summary["buckets_used"] if strategy != "dynamic" else len(summary["buckets_used"]),
        "unexpected_graphs": summary["unexpected_graphs"],
    }


def _median_run(runs: list[dict]) -> dict:
    """The run of median real tokens a second (the lower of the two middle ones for an even count), with every
    round's figure beside it."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_second"])
    return ordered[(len(ordered) - 1) // 2] | {"rounds_tokens_per_second": [r["tokens_per_second"] for r in runs]}


def measure(names: list[str], steps: int, rounds: int) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_number in range(rounds):
        for name in names if round_number % 2 == 0 else reversed(names):
            runs[name].append(run(name, steps))
    return {name: _median_run(results) for name, results in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--short-steps", type=int, default=40)
    parser.add_argument("--long-steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--long-dynamic", action="store_true", help="also run dynamic padding on the long run")
    args = parser.parse_args()
    static = [name for name in STRATEGIES if name != "dynamic"]
    out: dict = {"short": {"dynamic": run("dynamic", args.short_steps)}, "long": {}}
    out["short"] |= measure(static, args.short_steps, args.rounds)
    if args.long_dynamic:
        out["long"]["dynamic"] = run("dynamic", args.long_steps)
    out["long"] |= measure(static, args.long_steps, args.rounds)
    for length in ("short", "long"):
        res = out[length]
        best_fixed = min(res[k]["wall_seconds"] for k in ("pad_to_max", "buckets"))
        res["auto_vs_best_fixed_speedup"] = round(best_fixed / res["auto"]["wall_seconds"], 3)
        best_bucketing = max(res[k]["tokens_per_second"] for k in ("pad_to_max", "buckets", "auto"))
        res["packed_vs_best_bucketing_tokens_per_second"] = round(
            res["packed"]["tokens_per_second"] / best_bucketing, 2
        )
        if "dynamic" in res:
            res["auto_vs_dynamic_speedup"] = round(res["dynamic"]["wall_seconds"] / res["auto"]["wall_seconds"], 2)
    out["steps"] = {"short": args.short_steps, "long": args.long_steps, "rounds": args.rounds}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
