"""How long `submit` takes on this machine, and what it imports. Prints one JSON object.

    python benchmarks/submit_latency.py [--rounds 5]

Each round runs, in a fresh process timed from start to exit (interpreter start-up included):
  slurm:     neurontrain submit slurm recipes/tiny-llama-clm.yaml --nodes 2 (writes the sbatch script)
  sagemaker: neurontrain submit sagemaker recipes/tiny-llama-clm.yaml --role ... --output s3://... --dry-run
and, for comparison, `neurontrain --help`. A second pass runs each submit through `python -X importtime` and
reports whether torch, torch_xla or transformers were imported.
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
RECIPE = str(REPO / "recipes" / "tiny-llama-clm.yaml")
HEAVY = ("torch", "torch_xla", "transformers")


def commands(tmp: str) -> dict[str, list[str]]:
    return {
        "help": ["--help"],
        "slurm": ["submit", "slurm", RECIPE, "--nodes", "2", "-o", f"{tmp}/run", "--job-name", "bench"],
        "sagemaker": [
            "submit",
            "sagemaker",
            RECIPE,
            "--role",
            "arn:aws:iam::123456789012:role/Trainer",
            "--output",
            "s3://my-bucket/jobs",
            "--region",
            "us-west-2",
            "--job-name",
            "bench",
            "--dry-run",
        ],
    }


def timed(args: list[str]) -> float:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "neurontrain", *args], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"neurontrain {' '.join(args[:2])} failed: {res.stderr[-2000:]}")
    return wall


def imported(args: list[str]) -> list[str]:
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "neurontrain", *args], cwd=REPO, capture_output=True, text=True
    )
    names = {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    return sorted(n for n in names if n in HEAVY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    out: dict = {"python": sys.version.split()[0], "rounds": args.rounds, "seconds": {}, "heavy_imports": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in commands(tmp).items():
            walls = [timed(argv) for _ in range(args.rounds)]
            out["seconds"][name] = {"median": round(statistics.median(walls), 3), "max": round(max(walls), 3)}
            if name != "help":
                out["heavy_imports"][name] = imported(argv)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
