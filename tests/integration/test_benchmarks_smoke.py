"""Benchmarks that cannot rot: each script in benchmarks/ listed in SMOKE runs at a tiny size, runs its contenders
and prints its JSON, so a default change cannot break it silently. NOT_YET: the scripts that have no smoke size in
the suite yet (docs/status.md); a new script must join one of the two."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMOKE = {
    "loop_overhead.py": (["--steps", "6", "--log-every", "2", "--rounds", "1"], "overhead"),
}
NOT_YET = {
    "checkpoint_migrate.py",
    "compile_cache.py",
    "data_scale.py",
    "data_service.py",
    "gpu_backend_choice.py",
    "gpu_reference.py",
    "health.py",
    "lightning_graphs.py",
    "memory_scaling.py",
    "native_tp.py",
    "native_vs_xla.py",
    "scaling.py",
    "static_shapes.py",
    "submit_latency.py",
}


def test_every_benchmark_is_smoke_tested_or_listed_as_not_yet():
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py")}
    assert scripts == set(SMOKE) | NOT_YET and not set(SMOKE) & NOT_YET


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_a_benchmark_runs_its_contenders_and_prints_json(script):
    args, key = SMOKE[script]
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout)
    assert isinstance(figures[key], float)
