"""The GPU reference run of a move to Trainium: eager against native (`torch.compile`, inductor) on CUDA, through
`neurontrain run` in fresh processes. Prints one JSON line per run as it finishes, then the whole result as one
JSON object (last line; also written to --out).

    python benchmarks/gpu_reference.py                          # a CUDA host: about 5 minutes on an H100
    python benchmarks/gpu_reference.py --device cpu --steps 3   # a smoke check anywhere (tiny shapes only)

- Tiny BERT and tiny Llama, eager and native, `--tiny-steps` steps in fp32 without dropout: `fidelity`, the
  largest relative difference of the logged losses (must be <= 1e-5), and native's compilations against its
  planned graphs.
- A BERT-base shape (768 x 12 layers, batch 32, <= 128 tokens, `--steps` steps, bf16): real tokens a second on
  eager, native (auto buckets, priced by the planner) and native packed; native's compile seconds cold (empty
  inductor cache) and warm (a second run on the same inductor cache), each against the planner's estimate
  (`compile_ratio`: measured / estimated, must be within 0.5..2); packed: cold only.
Everything stops starting new runs after --budget seconds (330: the whole script stays under 6 minutes).
On `--device cpu` the BERT-base section keeps the tiny recipe's shape (inductor on a CPU compiles BERT-base for
minutes). Every run has its own timeout (--run-timeout): one that overruns is reported and the next one starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
QUIET = ["checkpoint.every=0", "checkpoint.save_final=false", "train.eval_at_end=false", "runtime.preflight=false"]
NO_DROPOUT = {
    "tiny-bert-classification": [
        "model.config.hidden_dropout_prob=0.0",
        "model.config.attention_probs_dropout_prob=0.0",
    ],
    "tiny-llama-clm": ["model.config.attention_dropout=0.0"],
}
BERT_BASE = [
    "model.config.hidden_size=768",
    "model.config.num_hidden_layers=12",
    "model.config.num_attention_heads=12",
    "model.config.intermediate_size=3072",
    "model.config.max_position_embeddings=512",
    "data.batch_size=32",
    "data.max_length=128",
    "data.train_samples=6000",
    "data.eval_samples=0",
    "train.precision=bf16",
    "runtime.matmul_precision=high",  # TF32 for what stays in float32
]


def _run(name: str, recipe: str, backend: str, sets: list[str], work: Path, env: dict, timeout: int) -> dict:
    out = work / name
    args = [sys.executable, "-m", "neurontrain", "run", str(RECIPES / f"{recipe}.yaml"), "--backend", backend]
    args += ["--output-dir", str(out), "--no-preflight"]
    for item in [*QUIET, *sets]:
        args += ["--set", item]
    started = time.perf_counter()
    try:
        proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "process_seconds": round(wall, 1),
        "wall_seconds": round(summary["wall_seconds"], 1),
        "compilations": summary["compilations"],
        "expected_graphs": summary["expected_graphs"],
        "unexpected_graphs": summary["unexpected_graphs"],
        "uncompiled_graphs": len(summary.get("uncompiled_graphs", [])),
        "compile_seconds": round(summary["compile_seconds"], 1),
        "tokens_per_second": round(summary["tokens_per_second"]),
        "padding_fraction": round(summary["padding_fraction"], 4),
        "bucket_mode": summary["bucket_mode"],
        "buckets": summary["buckets"],
        "final_loss": summary["final_loss"],
        "losses": [r["loss"] for r in rows if "loss" in r],
    }


def _fidelity(a: dict, b: dict) -> float | None:
    if "losses" not in a or "losses" not in b or len(a["losses"]) != len(b["losses"]):
        return None
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a["losses"], b["losses"]))


def _estimate(recipe: str, sets: list[str], graphs: int) -> float:
    """The planner's compile seconds for `graphs` graphs of this model on this host's native target."""
    from neurontrain.data.buckets import compile_seconds_per_graph
    from neurontrain.model.build import build_config, model_dims
    from neurontrain.plan.buckets import cost_key
    from neurontrain.recipe import load_recipe

    loaded = load_recipe(RECIPES / f"{recipe}.yaml", sets)
    layers = model_dims(loaded, build_config(loaded, None)).n_layers
    return graphs * compile_seconds_per_graph(cost_key("native"), layers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=150, help="steps of the BERT-base-shaped runs")
    parser.add_argument("--tiny-steps", type=int, default=30, help="steps of the tiny fidelity runs")
    parser.add_argument("--run-timeout", type=int, default=150, help="seconds one run may take")
    parser.add_argument("--budget", type=int, default=330, help="seconds for everything: later runs are skipped")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))  # the planner's estimate comes from this checkout, installed or not
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_reference: error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result: dict = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "steps": args.steps,
        "tiny_steps": args.tiny_steps,
    }
    work = Path(tempfile.mkdtemp(prefix="gpu-reference-"))

    def record(name: str, value: object) -> None:
        result[name] = value
        shown = {k: v for k, v in value.items() if k != "losses"} if isinstance(value, dict) else value
        print(json.dumps({"partial": name, "value": shown}), flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))

    started = time.perf_counter()

    def run(name: str, recipe: str, backend: str, sets: list[str], cache: str) -> dict:
        run_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(work / cache)}
        left = args.budget - (time.perf_counter() - started)
        if left < 20:
            value = {"skipped": f"the {args.budget} s budget is spent"}
        else:
            value = _run(name, recipe, backend, sets, work, run_env, int(min(args.run_timeout, left)))
        record(name, value)
        return value

    tiny = [f"train.max_steps={args.tiny_steps}", "train.log_every=1", "train.precision=fp32"]
    tiny += [f"train.schedule.warmup_steps={max(1, args.tiny_steps // 10)}", "data.buckets=max"]
    for recipe in ("tiny-bert-classification", "tiny-llama-clm"):
        sets = [*tiny, *NO_DROPOUT[recipe]]
        eager = run(f"{recipe}-eager", recipe, "eager", sets, f"inductor-{recipe}")
        native = run(f"{recipe}-native", recipe, "native", sets, f"inductor-{recipe}")
        fidelity = _fidelity(eager, native)
        ok = fidelity is not None and fidelity <= 1e-5 and native.get("compilations") == native.get("expected_graphs")
        record(f"{recipe}-check", {"fidelity": fidelity, "compiles_at_plan": ok})

    shape = BERT_BASE if args.device == "cuda" else ["data.train_samples=600", "data.eval_samples=0"]
    base = [*shape, f"train.max_steps={args.steps}", "train.log_every=10"]
    base += [f"train.schedule.warmup_steps={max(1, args.steps // 15)}"]
    recipe = "tiny-bert-classification"
    run("bert-base-eager", recipe, "eager", [*base, "data.packing=off"], "inductor-base")
    for name, packing, temperatures in (
        ("bert-base-native", "off", ("cold", "warm")),  # warm: a second run on the inductor cache the cold one filled
        ("bert-base-native-packed", "on", ("cold",)),
    ):
        for temperature in temperatures:
            got = run(f"{name}-{temperature}", recipe, "native", [*base, f"data.packing={packing}"], f"inductor-{name}")
            if "error" in got or "skipped" in got:
                break
            if temperature == "cold":
                estimate = _estimate(recipe, [*base, f"data.packing={packing}"], got["expected_graphs"])
                ratio = got["compile_seconds"] / estimate if estimate else None
                record(f"{name}-compile-estimate", {"estimated_seconds": round(estimate, 1), "compile_ratio": ratio})
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps({k: v for k, v in result.items()}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
