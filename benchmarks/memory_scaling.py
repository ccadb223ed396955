"""Memory-scaled training at 2 workers: plain data parallelism vs ZeRO-1 vs activation checkpointing vs both, on a
~32 M-parameter Llama (generated config and text, no download). Prints one JSON object.

    python benchmarks/memory_scaling.py [--steps 12] [--rounds 2]

For each configuration: per-worker device bytes by category from the live tensors the trainer holds
(summary.json `device_bytes`), the largest graph's temporaries and total from XLA's own buffer assignment
(`--xla_dump_to`: the `*memory-usage-report.txt` XLA writes for each compiled module), the planner's estimate of
the same configuration (`run --dry-run`), the steady step time as a ratio to plain DP (medians over alternating
rounds), the largest relative loss difference to DP, and graphs compiled per run.

XLA:CPU removes the optimization barriers activation checkpointing inserts before it schedules, so on this
platform checkpointing shows in the HLO (barriers) and in losses, hardly in the buffer assignment: the saving is a
Neuron-side figure. ZeRO-1's saving is in the live optimizer state and shows here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 10,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
CONFIGURATIONS = {
    "dp": ["train.zero1=false", "train.activation_checkpointing=none"],
    "zero1": ["train.zero1=true", "train.activation_checkpointing=none"],
    "checkpointing": ["train.zero1=false", "train.activation_checkpointing=full"],
    "zero1+checkpointing": ["train.zero1=true", "train.activation_checkpointing=full"],
}


def base_settings(steps: int) -> list[str]:
    return [
        f"model.config={json.dumps(MODEL)}",
        "data.max_length=128",
        "data.buckets=[128]",
        "data.batch_size=2",
        "data.train_samples=400",
        "data.eval_samples=0",
        "train.grad_accum=2",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.schedule.warmup_steps=1",
        "checkpoint.every=0",
        "checkpoint.save_final=false",
    ]


def neurontrain(args: list[str], settings: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    recipe = REPO / "recipes" / "tiny-llama-clm.yaml"
    cmd = [sys.executable, "-m", "neurontrain", *args, str(recipe), *(w for s in settings for w in ("--set", s))]
    done = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done


def xla_buffer_assignment(dump: Path) -> dict:
    """The largest compiled graph by XLA's buffer assignment: total bytes, and the part that is neither an
    input (parameter) nor an output (live-out): temporaries, where activations live."""
    largest = {"total_bytes": 0, "temp_bytes": 0}
    for report in dump.glob("*memory-usage-report.txt"):
        text = report.read_text()
        total = int(re.search(r"Total bytes used: (\d+)", text).group(1))
        sizes = re.findall(r"allocation \d+: size ([\d.]+)(B|KiB|MiB|GiB), (\S+)", text)
        scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
        temp = sum(float(n) * scale[u] for n, u, kind in sizes if kind.startswith("preallocated-temp"))
        if total > largest["total_bytes"]:
            largest = {"total_bytes": total, "temp_bytes": int(temp)}
    return largest


def planner_estimate(settings: list[str]) -> dict:
    plan = json.loads(neurontrain(["run", "--dry-run", "--nproc-per-node", "2"], settings).stdout)
    return plan["memory"]


def train(settings: list[str], out: Path) -> dict:
    dump = out / "xla-dump"
    neurontrain(
        ["run", "-o", str(out), "--no-preflight", "--nproc-per-node", "2"],
        settings,
        env={"XLA_FLAGS": f"--xla_dump_to={dump}"},
    )
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    tokens = [r["tokens_per_second"] for r in records if "loss" in r and r["step"] > 2]
    return {
        "losses": losses,
        "steady_tokens_per_second": statistics.median(tokens),
        "compilations": summary["compilations"],
        "unexpected_graphs": summary["unexpected_graphs"],
        "optimizer_bytes": summary.get("optimizer_bytes"),
        "xla_largest_graph": xla_buffer_assignment(dump),
    }


def max_relative_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    settings = {name: base_settings(args.steps) + extra for name, extra in CONFIGURATIONS.items()}
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGURATIONS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):  # alternate the contenders, so machine noise hits all of them
            for name in CONFIGURATIONS:
                runs[name].append(train(settings[name], Path(tmp) / f"{name}-{i}"))
    dp_speed = statistics.median(r["steady_tokens_per_second"] for r in runs["dp"])
    report = {}
    for name, rounds in runs.items():
        speed = statistics.median(r["steady_tokens_per_second"] for r in rounds)
        report[name] = {
            "step_time_vs_dp": round(dp_speed / speed, 3),
            "max_loss_rel_diff_vs_dp": max_relative_difference(rounds[0]["losses"], runs["dp"][0]["losses"]),
            "compilations": rounds[0]["compilations"],
            "unexpected_graphs": rounds[0]["unexpected_graphs"],
            "optimizer_bytes_per_worker": rounds[0]["optimizer_bytes"],
            "xla_largest_graph": rounds[0]["xla_largest_graph"],
            "planner": planner_estimate(settings[name]),
        }
    print(json.dumps({"steps": args.steps, "rounds": args.rounds, "workers": 2, "configurations": report}, indent=2))


if __name__ == "__main__":
    main()
