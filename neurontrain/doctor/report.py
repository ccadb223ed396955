"""The doctor's report: one `CheckResult` per check, the JSON schema (versioned) and the table people read.

Pure logic, no torch. The report carries no environment values except those of `REPORTED_VARIABLES`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA = "neurontrain-doctor"
SCHEMA_VERSION = 1
DOCS = "docs/doctor.md"
# the only environment variables whose values a report shows (compiler and runtime settings, no credentials)
REPORTED_VARIABLES = (
    "NEURON_CC_FLAGS",
    "NEURON_COMPILE_CACHE_URL",
    "NEURON_PLATFORM_TARGET_OVERRIDE",
    "NEURON_EXTRACT_GRAPHS_ONLY",
    "NEURON_RT_VISIBLE_CORES",
    "NEURON_RT_NUM_CORES",
    "NEURON_LOGICAL_NC_CONFIG",
    "NEURONTRAIN_CACHE_DIR",
    "PJRT_DEVICE",
    "XLA_FLAGS",
)


@dataclass
class CheckResult:
    name: str
    status: str  # pass | fail | skipped
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)  # what the check measured
    message: str | None = None  # fail: what it means; skipped: why
    docs: str | None = None  # fail: the section of docs/doctor.md to read

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Verdict:
    """A check's outcome before timing: `problem` None is a pass."""

    figures: dict
    problem: str | None = None


def passed(**figures: Any) -> Verdict:
    return Verdict(figures)


def failed(problem: str, **figures: Any) -> Verdict:
    return Verdict(figures, problem)


def result_of(name: str, verdict: Verdict, seconds: float) -> CheckResult:
    if verdict.problem is None:
        return CheckResult(name, "pass", round(seconds, 2), verdict.figures)
    return CheckResult(name, "fail", round(seconds, 2), verdict.figures, verdict.problem, f"{DOCS}#{name}")


def skipped(name: str, reason: str) -> CheckResult:
    return CheckResult(name, "skipped", 0.0, {}, reason)


def reported_environment(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: environ[k] for k in REPORTED_VARIABLES if k in environ}


def build_report(
    mode: str, results: list[CheckResult], environ: Mapping[str, str], started: float, version: str
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "neurontrain": version,
        "mode": mode,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        "ok": exit_code(results) == 0,
        "environment": reported_environment(environ),
        "checks": [r.to_json() for r in results],
    }


def exit_code(results: list[CheckResult]) -> int:
    """0 when nothing failed, 3 when a check failed."""
    return 3 if any(r.status == "fail" for r in results) else 0


def _figures(figures: dict, limit: int = 110) -> str:
    text = ", ".join(f"{k}={v}" for k, v in figures.items() if not isinstance(v, (dict, list)))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_table(results: list[CheckResult]) -> str:
    lines = [f"{'check':<18} {'status':<8} {'seconds':>8}  figures / message"]
    for r in results:
        lines.append(f"{r.name:<18} {r.status:<8} {r.seconds:>8.1f}  {_figures(r.figures)}")
        if r.message:
            lines.append(f"{'':<37}{'-> ' + r.message}" + (f" (see {r.docs})" if r.docs else ""))
    return "\n".join(lines)
