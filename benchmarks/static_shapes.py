"""Dynamic padding vs pad-to-max vs fixed buckets vs auto buckets, on the same data and model, through
`neurontrain run` on the embedded backend (XLA:CPU). Prints one JSON object.

    python benchmarks/static_shapes.py [--short-steps 40] [--long-steps 400]

Each strategy runs in a fresh process, so every run pays its own compiles (XLA:CPU cannot reload
compiled executables across processes). wall_seconds is the training loop including compiles, as
reported in summary.json; tokens_per_second counts real (non-pad) tokens over that time.
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
}


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--short-steps", type=int, default=40)
    parser.add_argument("--long-steps", type=int, default=400)
    parser.add_argument("--long-dynamic", action="store_true", help="also run dynamic padding on the long run")
    args = parser.parse_args()
    out: dict = {"short": {}, "long": {}}
    for name in STRATEGIES:
        out["short"][name] = run(name, args.short_steps)
    for name in STRATEGIES:
        if name != "dynamic" or args.long_dynamic:
            out["long"][name] = run(name, args.long_steps)
    for length in ("short", "long"):
        res = out[length]
        best_fixed = min(res[k]["wall_seconds"] for k in ("pad_to_max", "buckets"))
        res["auto_vs_best_fixed_speedup"] = round(best_fixed / res["auto"]["wall_seconds"], 3)
        if "dynamic" in res:
            res["auto_vs_dynamic_speedup"] = round(res["dynamic"]["wall_seconds"] / res["auto"]["wall_seconds"], 2)
    out["steps"] = {"short": args.short_steps, "long": args.long_steps}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
