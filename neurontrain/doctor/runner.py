"""Run the doctor's checks in order, each timed; a check's own failure to run is its verdict, never a crash."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from neurontrain.doctor.checks import CHECKS, Check, Skip
from neurontrain.doctor.context import DoctorContext, StageFailed
from neurontrain.doctor.report import CheckResult, failed, result_of, skipped


@dataclass(kw_only=True)
class DoctorOptions:
    mode: str = "quick"  # quick | full
    nproc_per_node: int = 2
    backend: str = "auto"
    keep: Path | None = None  # keep the scratch runs (logs, caches, checkpoints) here


def selected(mode: str, names: Iterable[str] | None = None) -> list[Check]:
    wanted = set(names) if names else None
    return [c for c in CHECKS if (wanted is None or c.name in wanted) and (mode == "full" or c.quick or wanted)]


def run_check(check: Check, ctx: DoctorContext) -> CheckResult:
    start = time.perf_counter()
    try:
        verdict = check.run(ctx)
    except Skip as reason:
        return skipped(check.name, str(reason))
    except StageFailed as exc:
        verdict = failed(str(exc))
    return result_of(check.name, verdict, time.perf_counter() - start)


def run_doctor(options: DoctorOptions, on_result: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    scratch = options.keep or Path(tempfile.mkdtemp(prefix="neurontrain-doctor-"))
    ctx = DoctorContext(scratch, nproc=options.nproc_per_node, backend=options.backend)
    results = []
    try:
        for check in selected(options.mode):
            results.append(run_check(check, ctx))
            if on_result is not None:
                on_result(results[-1])
    finally:
        if options.keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return results
