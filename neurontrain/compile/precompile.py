"""`neurontrain precompile`: discover a recipe's graphs, record them, and compile them ahead of time where
the runtime can reuse compiled graphs (Neuron: the runtime's own extraction and parallel compile phase, into
its persistent cache)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from neurontrain.backends import Backend
from neurontrain.compile.discover import discover
from neurontrain.compile.manifest import GraphRecord, Manifest, manifest_path, save_manifest
from neurontrain.compile.neuron_runtime import Extractor
from neurontrain.compile.runtime_compile import compile_modules
from neurontrain.health.worker import device_checks
from neurontrain.plan.planning import RunPlan


@dataclass
class PrecompileReport:
    """What `precompile` did; its fields are the JSON report (`--json`)."""

    target: str
    manifest: str
    discovery_seconds: float
    graphs_found: int = 0
    already_cached: int = 0
    compiled: int = 0
    failed: int = 0
    seconds: float = 0.0
    graphs: list[dict] = field(default_factory=list)
    note: str = ""

    def table(self) -> str:
        lines = [f"{'graph':<22} {'shapes':<14} {'graph id':<18} {'runtime module':<34} {'status':<10} {'seconds':>8}"]
        for row in self.graphs:
            module = ",".join(m.split("/")[-1] for m in row["modules"]) or "-"
            lines.append(
                f"{row['graph']:<22} {row['shapes']:<14} {row['graph_id'][:16]:<18} {module:<34} "
                f"{row['status']:<10} {row['seconds']:>8.2f}"
            )
        lines.append(
            f"graphs found {self.graphs_found}, already cached {self.already_cached}, compiled {self.compiled}, "
            f"failed {self.failed}, {self.seconds:.1f} s (discovery {self.discovery_seconds:.2f} s)"
        )
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {**asdict(self), "seconds": round(self.seconds, 3)}


def _label(key: list) -> str:
    return key[0] if len(key) == 1 else f"{key[0]} {key[1]}"


def precompile(
    plan: RunPlan, backend: Backend, cache_root: Path, through_runtime: bool = False, workers: int | None = None
) -> PrecompileReport:
    """through_runtime: the Neuron runtime extracts each traced graph (naming its module itself) and its own
    parallel compile phase compiles them; otherwise graphs are only recorded."""
    start = time.perf_counter()
    manifest = _discover(plan, backend, cache_root, through_runtime)
    return report_manifest(manifest, cache_root, backend.name, through_runtime, workers, start)


def report_manifest(
    manifest: Manifest,
    cache_root: Path,
    backend_name: str,
    through_runtime: bool,
    workers: int | None = None,
    start: float | None = None,
) -> PrecompileReport:
    """Save the manifest; with the runtime, compile its extracted modules; the report of both."""
    start = time.perf_counter() if start is None else start
    path = manifest_path(cache_root, manifest.recipe, manifest.plan_id)
    save_manifest(path, manifest)
    report = PrecompileReport(
        target="neuron" if through_runtime else "none",
        manifest=str(path),
        discovery_seconds=manifest.discovery_seconds,
        graphs_found=len(manifest.graphs),
    )
    statuses: dict[str, tuple[str, float]] = {}
    if through_runtime:
        statuses = _compile(report, manifest, cache_root, workers)
    else:
        report.note = (
            f"{backend_name}: graphs recorded in the manifest; this runtime cannot reload compiled "
            "executables across processes, so compilation happens at run time."
        )
    report.graphs = [_graph_row(g, statuses, through_runtime) for g in manifest.graphs]
    report.seconds = time.perf_counter() - start
    return report


def _discover(plan: RunPlan, backend: Backend, cache_root: Path, through_runtime: bool) -> Manifest:
    extractor = Extractor(cache_root) if through_runtime else None
    try:
        manifest = discover(plan, backend, cache_root, extract=extractor.extract if extractor else None)
        if extractor is not None and plan.recipe.runtime.preflight:
            manifest.graphs.append(_preflight_record(backend, extractor))
    finally:
        if extractor is not None:
            extractor.close()
    return manifest


def _compile(
    report: PrecompileReport, manifest: Manifest, cache_root: Path, workers: int | None
) -> dict[str, tuple[str, float]]:
    """Compile the manifest's modules with the runtime; count the outcomes into the report."""
    without = [g for g in manifest.graphs if not g.modules]
    results = compile_modules(cache_root, manifest.module_names(), workers)
    report.already_cached = sum(1 for r in results if r.status == "cached")
    report.compiled = sum(1 for r in results if r.status == "compiled")
    report.failed = sum(1 for r in results if r.status not in ("compiled", "cached")) + len(without)
    if without:
        report.note = (
            f"the Neuron runtime wrote no module for {len(without)} graph(s) "
            f"({', '.join(_label(g.key) for g in without)}): is it the runtime that compiles here?"
        )
    return {res.module: (res.status, res.seconds) for res in results}


def _graph_row(g: GraphRecord, statuses: dict[str, tuple[str, float]], through_runtime: bool) -> dict:
    rows = [statuses.get(m, ("missing", 0.0)) for m in g.modules]
    rows = rows or [("recorded" if not through_runtime else "no module", 0.0)]
    status = next((st for st, _ in rows if st not in ("cached", "compiled")), rows[0][0])
    return {
        "graph": _label(g.key),
        "shapes": "x".join(map(str, g.shapes.get("input_ids", []))) or "-",
        "graph_id": g.graph_id,
        "modules": g.modules,
        "status": status,
        "seconds": round(sum(sec for _, sec in rows), 3),
        "trace_seconds": g.trace_seconds,
    }


def _preflight_record(backend: Backend, extractor: Extractor) -> GraphRecord:
    """The preflight's device checks compile graphs of their own before training: extract them too (their
    results are meaningless in extraction mode and ignored)."""
    t0 = time.perf_counter()
    modules = extractor.extract(lambda: (device_checks(backend, None), backend.sync()))
    return GraphRecord(["preflight"], {}, "", "", 0, round(time.perf_counter() - t0, 4), modules)
