"""The tiny recipes on the native backend (`torch.compile`, inductor on CPU) vs XLA:CPU, through
`neurontrain run` in fresh processes. Prints one JSON object.

    python benchmarks/native_vs_xla.py [--steps 40] [--rounds 2] [--recipes tiny-llama-clm,tiny-bert-classification]

Per recipe and backend, each round (contenders alternate, medians reported):

- `compile_seconds`: the run's own compile time (summary.json: XLA's compiles; TorchDynamo + inductor on native),
  every native round with an empty inductor cache and an empty compile cache.
- `steady_tokens_per_second`: the median of the logged steps' real tokens a second once the run has compiled all
  it compiles (steps whose compile count is already the final one, after step 2).
- `start_seconds`: the wall time of a fresh `neurontrain run` of `--start-steps` steps (process start to exit:
  imports, data, compiles, the steps), cold. On native also `start_seconds_cached`: the same run after
  `neurontrain precompile --backend native` filled a compile cache (fresh process, empty inductor cache, the
  compile cache given as runtime.compile_cache); XLA:CPU cannot reload compiled executables across processes,
  so it has no cached figure.

Ratios are native over XLA:CPU (throughput: above 1 is native faster; seconds: below 1 is native faster).
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
COMMON = [
    "--set",
    "checkpoint.every=0",
    "--set",
    "checkpoint.save_final=false",
    "--set",
    "train.eval_at_end=false",
    "--set",
    "train.eval_every=0",
]
RUN = ["run", "--no-preflight"]
BACKENDS = ("xla-cpu", "native")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def environment(inductor_dir: Path) -> dict[str, str]:
    """A child's environment: XLA on CPU, and inductor's on-disk cache in a directory of this round's own."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    env.pop("NEURONTRAIN_CACHE_DIR", None)
    return env


def cli(args: list[str], env: dict[str, str]) -> float:
    """Run `neurontrain ARGS`; its wall seconds (raises with the child's last output on failure)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "neurontrain", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"neurontrain {' '.join(args[:3])} failed ({done.returncode}): {done.stderr[-2000:]}")
    return time.perf_counter() - start


def recipe_args(recipe: str, backend: str, steps: int, cache: Path) -> list[str]:
    path = REPO / "recipes" / f"{recipe}.yaml"
    return [
        str(path),
        "--backend",
        backend,
        "--set",
        f"train.max_steps={steps}",
        "--set",
        f"runtime.compile_cache={cache}",
        *COMMON,
    ]


def steady_throughput(out: Path) -> float | None:
    """The median real tokens a second of the logged steps after every compile (and after step 2)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    final = steps[-1]["compilations"] if steps else None
    steady = [r["tokens_per_second"] for r in steps if r["step"] > 2 and r["compilations"] == final]
    return statistics.median(steady) if steady else None


def training_round(recipe: str, backend: str, steps: int, work: Path) -> dict:
    """One cold training run: compile seconds and steady throughput."""
    out = work / "run"
    args = recipe_args(recipe, backend, steps, work / "cache")
    cli([*RUN, *args, "--set", "train.log_every=1", "--output-dir", str(out)], environment(work / "inductor"))
    summary = json.loads((out / "summary.json").read_text())
    return {
        "compile_seconds": summary["compile_seconds"],
        "compilations": summary["compilations"],
        "steady_tokens_per_second": steady_throughput(out),
    }


def start_args(recipe: str, backend: str, steps: int, cache: Path) -> list[str]:
    """A start-time run's arguments: a few steps, so no warm-up (the recipes' warm-up must be shorter than the run)."""
    return [*recipe_args(recipe, backend, steps, cache), "--set", "train.schedule.warmup_steps=0"]


def start_round(recipe: str, backend: str, steps: int, work: Path) -> dict:
    """Fresh-process start: cold, and on native also after precompile filled a compile cache."""
    figures = {}
    cold = work / "cold"
    args = start_args(recipe, backend, steps, cold / "cache")
    figures["start_seconds"] = cli([*RUN, *args, "--output-dir", str(cold / "run")], environment(cold / "inductor"))
    if backend == "native":
        cached = work / "cached"
        args = start_args(recipe, backend, steps, cached / "cache")
        cli(["precompile", *args, "--cache", str(cached / "cache")], environment(cached / "inductor-precompile"))
        env = environment(cached / "inductor-run")  # empty: only the compile cache can help
        figures["start_seconds_cached"] = cli([*RUN, *args, "--output-dir", str(cached / "run")], env)
        summary = json.loads((cached / "run" / "summary.json").read_text())
        figures["cached_run_compilations"] = summary["compilations"]
        figures["cached_run_cache"] = summary.get("compile_cache")
    return figures


def median_of(rounds: list[dict], field: str) -> float | None:
    values = [r[field] for r in rounds if r.get(field) is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare(recipe: str, args: argparse.Namespace, work: Path) -> dict:
    rounds: dict[str, list[dict]] = {backend: [] for backend in BACKENDS}
    for index in range(args.rounds):
        order = BACKENDS if index % 2 == 0 else tuple(reversed(BACKENDS))
        for backend in order:
            log(f"{recipe} {backend} round {index + 1}/{args.rounds}")
            place = Path(tempfile.mkdtemp(dir=work, prefix=f"{recipe}-{backend}-"))
            figures = training_round(recipe, backend, args.steps, place / "train")
            figures.update(start_round(recipe, backend, args.start_steps, place / "start"))
            rounds[backend].append(figures)
    fields = ("compile_seconds", "steady_tokens_per_second", "start_seconds", "start_seconds_cached")
    medians = {b: {f: median_of(rounds[b], f) for f in fields} for b in BACKENDS}
    native, xla = medians["native"], medians["xla-cpu"]
    return {
        "medians": medians,
        "native_over_xla": {
            "compile_seconds": ratio(native["compile_seconds"], xla["compile_seconds"]),
            "steady_tokens_per_second": ratio(native["steady_tokens_per_second"], xla["steady_tokens_per_second"]),
            "start_seconds": ratio(native["start_seconds"], xla["start_seconds"]),
        },
        "native_cached_over_cold_start": ratio(native["start_seconds_cached"], native["start_seconds"]),
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps of the training runs")
    parser.add_argument("--start-steps", type=int, default=2, help="steps of the start-time runs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--recipes", default="tiny-llama-clm,tiny-bert-classification")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="native-vs-xla-") as tmp:
        result = {
            "steps": args.steps,
            "start_steps": args.start_steps,
            "rounds": args.rounds,
            "recipes": {recipe: compare(recipe, args, Path(tmp)) for recipe in args.recipes.split(",")},
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
