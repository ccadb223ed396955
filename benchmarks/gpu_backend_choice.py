"""`auto` on a CUDA host, priced on the whole job, against the two backends it chooses between: the BERT-base shape of
`gpu_reference.py` (768 x 12 layers, batch 32, <= 128 tokens, bf16, no evaluation), `neurontrain run` end to end in
fresh processes at each --steps, with `auto`, `--backend eager` and `--backend native` (each native run on an empty
inductor cache: the compile a first run pays, as the planner prices it). Prints one JSON line per run as it finishes,
then the whole result as one JSON object (last line; also written to --out).

    python benchmarks/gpu_backend_choice.py --out choice.json      # a CUDA host without torch-xla: about 6 minutes

Per steps: `auto_took` (the backend auto ran), `fastest` (of eager and native, by the process's wall seconds, start
to finish), and `auto_right` (whether auto took the fastest). Runs stop starting after --budget seconds.
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

from gpu_reference import BERT_BASE, QUIET  # benchmarks/: the script's own directory is on sys.path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-bert-classification.yaml"
SETS = [*QUIET, *BERT_BASE, "train.log_every=50"]  # the GPU reference run's BERT-base shape


def _run(backend: str, steps: int, work: Path, timeout: float) -> dict:
    out = work / f"{backend}-{steps}"
    args = [sys.executable, "-m", "neurontrain", "run", str(RECIPE), "--output-dir", str(out), "--no-preflight"]
    args += [] if backend == "auto" else ["--backend", backend]
    for item in [*SETS, f"train.max_steps={steps}", f"train.schedule.warmup_steps={max(1, steps // 15)}"]:
        args += ["--set", item]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{backend}-{steps}")}
    started = time.perf_counter()
    try:
        proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - started
    said = [line.split("backend auto -> ", 1)[1] for line in proc.stderr.splitlines() if "backend auto -> " in line]
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    summary = json.loads((out / "summary.json").read_text())
    return {
        "process_seconds": round(wall, 1),
        "backend": summary["backend"],
        "auto_said": said[-1] if said else None,
        "train_wall_seconds": round(summary["wall_seconds"], 1),
        "compile_seconds": round(summary["compile_seconds"], 1),
        "compilations": summary["compilations"],
        "expected_graphs": summary["expected_graphs"],
        "unexpected_graphs": summary["unexpected_graphs"],
        "tokens_per_second": round(summary["tokens_per_second"]),
        "padding_fraction": round(summary["padding_fraction"], 4),
        "bucket_mode": summary["bucket_mode"],
        "per_worker_batch": summary["per_worker_batch"],
        "final_loss": summary["final_loss"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=[150, 1000])
    parser.add_argument("--budget", type=float, default=380, help="seconds after which no run starts")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_backend_choice: error: torch sees no CUDA device", file=sys.stderr)
        return 2
    result: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": {}}
    work = Path(tempfile.mkdtemp(prefix="backend-choice-"))
    started = time.perf_counter()
    for steps in args.steps:
        for backend in ("eager", "native", "auto"):
            left = args.budget - (time.perf_counter() - started)
            got = {"skipped": "budget spent"} if left < 20 else _run(backend, steps, work, left)
            result["runs"][f"{backend}-{steps}"] = got
            print(json.dumps({"run": f"{backend}-{steps}", **got}), flush=True)
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))
        runs = {b: result["runs"][f"{b}-{steps}"] for b in ("eager", "native", "auto")}
        timed = {b: r["process_seconds"] for b, r in runs.items() if "process_seconds" in r and b != "auto"}
        fastest = min(timed, key=timed.get) if len(timed) == 2 else None
        took = runs["auto"].get("backend")
        result[f"verdict-{steps}"] = {"auto_took": took, "fastest": fastest, "auto_right": took == fastest}
    result["seconds"] = round(time.perf_counter() - started, 1)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
