"""Native tensor parallel on CPU with gloo, through `neurontrain run` in fresh processes. Two reports:

    python benchmarks/native_tp.py families [--steps 6] [--families qwen2,gemma2] [--out FILE]
    python benchmarks/native_tp.py speed [--steps 30] [--rounds 2]

`families`: every family of tests/families.py (but the three the suite trains at TP 2: NATIVE_TP_SUITE) whose
transformers config has a tensor-parallel plan, as a tiny model (tests/families.py's sizes) on the tiny Llama
recipe: one eager worker of 16 rows a step against two native workers at TP 2 (parallel.tp=2, 16 rows: the same
global batch), the largest relative loss difference over the steps, the TP run's graphs (compiled, planned,
unexpected) and whether its loss fell. A family without a plan is recorded as such, not run (`run` refuses it in
one line: tests/unit/test_native_tp_plan.py). Writes the JSON that README's families table column "TP training
(native)" is generated from (tests/families.py reads it), and prints it.

`speed`: tiny Llama on two native workers, TP 2 against DDP 2 (data parallel, 8 rows each: the same global batch
of 16), rounds alternating the contenders: the median step time of the steps after compilation (metrics.jsonl's
wall clock between consecutive steps), and each worker's device bytes (summary.json: parameters, gradients, AdamW
moments). Ratios are TP 2 over DDP 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from families import FAMILIES, NATIVE_TP_SUITE, tiny_config_values  # noqa: E402  # the tests' own list and sizes

ROWS = 16
COMMON = [
    "--no-preflight",
    *("--set", "train.log_every=1", "--set", "train.precision=fp32", "--set", "train.eval_at_end=false"),
    *("--set", "train.schedule.warmup_steps=1", "--set", "checkpoint.every=0", "--set", "checkpoint.save_final=false"),
    *("--set", "data.train_samples=400", "--set", "data.max_length=64", "--set", "data.buckets=[64]"),
]
EAGER = ["--backend", "eager", "--set", f"data.batch_size={ROWS}"]
TP2 = ["--backend", "native", "--nproc-per-node", "2", "--set", "parallel.tp=2", "--set", f"data.batch_size={ROWS}"]
DDP2 = ["--backend", "native", "--nproc-per-node", "2", "--set", f"data.batch_size={ROWS // 2}"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def has_plan(model_type: str) -> bool:
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.for_model(model_type), "base_model_tp_plan", None))


def recipe_for(root: Path, model_type: str) -> Path:
    recipe = yaml.safe_load((REPO / "recipes" / "tiny-llama-clm.yaml").read_text())
    recipe["model"]["config"] = tiny_config_values(model_type)
    path = root / f"{model_type}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run(recipe: Path, out: Path, steps: int, extra: list[str]) -> subprocess.CompletedProcess:
    args = ["run", str(recipe), *COMMON, "--set", f"train.max_steps={steps}", *extra, "-o", str(out)]
    return subprocess.run([sys.executable, "-m", "neurontrain", *args], capture_output=True, text=True, cwd=REPO)


def metrics(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "loss" in r]


def family_row(root: Path, model_type: str, steps: int) -> dict:
    """One family: eager against TP 2, or the refusal."""
    recipe = recipe_for(root, model_type)
    tp = run(recipe, root / f"{model_type}-tp", steps, TP2)
    if tp.returncode != 0:
        lines = [line for line in tp.stderr.splitlines() if line.startswith("neurontrain: error")]
        return {"family": model_type, "trained": False, "exit": tp.returncode, "error": (lines or ["?"])[-1]}
    eager = run(recipe, root / f"{model_type}-eager", steps, EAGER)
    if eager.returncode != 0:
        raise SystemExit(f"{model_type} eager failed:\n{eager.stderr[-3000:]}")
    one = {r["step"]: r["loss"] for r in metrics(root / f"{model_type}-eager")}
    two = {r["step"]: r["loss"] for r in metrics(root / f"{model_type}-tp")}
    summary = json.loads((root / f"{model_type}-tp" / "summary.json").read_text())
    return {
        "family": model_type,
        "trained": True,
        "steps": steps,
        "max_relative_loss_difference": max(abs(one[s] - two[s]) / abs(one[s]) for s in one),
        "loss_fell": two[steps] < two[1],
        "compilations": summary["compilations"],
        "expected_graphs": summary["expected_graphs"],
        "unexpected_graphs": summary["unexpected_graphs"],
    }


def families(args: argparse.Namespace) -> None:
    default = [f.model_type for f in FAMILIES if f.model_type not in NATIVE_TP_SUITE]  # those: in the suite
    chosen = args.families.split(",") if args.families else default
    out = json.loads(args.out.read_text()) if args.out.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in chosen:
            if not has_plan(model_type):
                out[model_type] = {"family": model_type, "trained": False, "error": "no base_model_tp_plan"}
                continue
            log(f"{model_type}: TP 2 against eager, {args.steps} steps")
            out[model_type] = family_row(Path(tmp), model_type, args.steps)
            log(json.dumps(out[model_type]))
    args.out.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(json.dumps(out, indent=2, sort_keys=True))


def step_seconds(out: Path) -> float:
    """The median wall seconds between consecutive logged steps once the run compiled all it compiles."""
    rows = metrics(out)
    final = rows[-1]["compilations"]
    times = [r["time"] for r in rows if r["compilations"] == final][2:]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def speed(args: argparse.Namespace) -> None:
    recipe = REPO / "recipes" / "tiny-llama-clm.yaml"
    seconds: dict[str, list[float]] = {"tp2": [], "ddp2": []}
    memory: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, extra in (("tp2", TP2), ("ddp2", DDP2))[:: 1 if round_ % 2 == 0 else -1]:
                out = Path(tmp) / f"{name}-{round_}"
                done = run(recipe, out, args.steps, extra)
                if done.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
                seconds[name].append(step_seconds(out))
                memory[name] = json.loads((out / "summary.json").read_text())["device_bytes"][0]
                log(f"round {round_} {name}: {seconds[name][-1]:.4f} s a step")
    median = {name: statistics.median(values) for name, values in seconds.items()}
    kinds = ("parameters", "gradients", "optimizer")
    print(
        json.dumps(
            {
                "steps": args.steps,
                "rounds": args.rounds,
                "global_batch": ROWS,
                "step_seconds_median": median,
                "step_seconds": seconds,
                "device_bytes_per_worker": {name: {k: memory[name][k] for k in kinds} for name in memory},
                "ratio_step_seconds_tp2_over_ddp2": median["tp2"] / median["ddp2"],
                "ratio_state_bytes_tp2_over_ddp2": sum(memory["tp2"][k] for k in kinds)
                / sum(memory["ddp2"][k] for k in kinds),
            },
            indent=2,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    fam = sub.add_parser("families")
    fam.add_argument("--steps", type=int, default=6)
    fam.add_argument("--families", help="comma-separated model types (default: those the suite does not train)")
    fam.add_argument("--out", type=Path, default=REPO / "benchmarks" / "native_tp_families.json")
    spd = sub.add_parser("speed")
    spd.add_argument("--steps", type=int, default=30)
    spd.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    families(args) if args.what == "families" else speed(args)


if __name__ == "__main__":
    main()
