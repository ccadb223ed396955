"""`neurontrain precompile`: discover a recipe's graphs, record them, and compile them ahead of time where
the runtime can reuse compiled graphs (Neuron: the runtime's own extraction and parallel compile phase, into
its persistent cache)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from neurontrain.backend import Backend
from neurontrain.compile.discover import discover
from neurontrain.compile.manifest import GraphRecord, Manifest, manifest_path, save_manifest
from neurontrain.compile.neuron_runtime import Extractor
from neurontrain.compile.runtime_compile import compile_modules
from neurontrain.health.worker import device_checks
from neurontrain.loop.planning import RunPlan


@dataclass
class PrecompileReport:
    manifest: Manifest
    manifest_file: Path
    target: str
    found: int = 0
    cached: int = 0
    compiled: int = 0
    failed: int = 0
    seconds: float = 0.0
    rows: list[dict] = field(default_factory=list)
    note: str = ""

    def table(self) -> str:
        lines = [f"{'graph':<22} {'shapes':<14} {'graph id':<18} {'runtime module':<34} {'status':<10} {'seconds':>8}"]
        for row in self.rows:
            module = ",".join(m.split("/")[-1] for m in row["modules"]) or "-"
            lines.append(
                f"{row['graph']:<22} {row['shapes']:<14} {row['graph_id'][:16]:<18} {module:<34} "
                f"{row['status']:<10} {row['seconds']:>8.2f}"
            )
        lines.append(
            f"graphs found {self.found}, already cached {self.cached}, compiled {self.compiled}, "
            f"failed {self.failed}, {self.seconds:.1f} s (discovery {self.manifest.discovery_seconds:.2f} s)"
        )
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "manifest": str(self.manifest_file),
            "graphs_found": self.found,
            "already_cached": self.cached,
            "compiled": self.compiled,
            "failed": self.failed,
            "seconds": round(self.seconds, 3),
            "discovery_seconds": self.manifest.discovery_seconds,
            "graphs": self.rows,
            "note": self.note,
        }


def _label(key: list) -> str:
    return key[0] if len(key) == 1 else f"{key[0]} {key[1]}"


def precompile(
    plan: RunPlan, backend: Backend, cache_root: Path, through_runtime: bool = False, workers: int | None = None
) -> PrecompileReport:
    """through_runtime: the Neuron runtime extracts each traced graph (naming its module itself) and its own
    parallel compile phase compiles them; otherwise graphs are only recorded."""
    start = time.perf_counter()
    extractor = Extractor(cache_root) if through_runtime else None
    try:
        manifest = discover(plan, backend, cache_root, extract=extractor.extract if extractor else None)
        if extractor is not None and plan.recipe.runtime.preflight:
            manifest.graphs.append(_preflight_record(backend, extractor))
    finally:
        if extractor is not None:
            extractor.close()
    path = manifest_path(cache_root, plan.recipe.name, manifest.plan_id)
    save_manifest(path, manifest)
    report = PrecompileReport(manifest, path, "neuron" if through_runtime else "none", found=len(manifest.graphs))
    statuses: dict[str, tuple[str, float]] = {}
    if through_runtime:
        without = [g for g in manifest.graphs if not g.modules]
        results = compile_modules(cache_root, manifest.module_names(), workers)
        for res in results:
            statuses[res.module] = (res.status, res.seconds)
        report.cached = sum(1 for r in results if r.status == "cached")
        report.compiled = sum(1 for r in results if r.status == "compiled")
        report.failed = sum(1 for r in results if r.status != "compiled" and r.status != "cached") + len(without)
        if without:
            report.note = (
                f"the Neuron runtime wrote no module for {len(without)} graph(s) "
                f"({', '.join(_label(g.key) for g in without)}): is it the runtime that compiles here?"
            )
    else:
        report.note = (
            f"{backend.name}: graphs recorded in the manifest; this runtime cannot reload compiled "
            "executables across processes, so compilation happens at run time."
        )
    for g in manifest.graphs:
        rows = [statuses.get(m, ("missing", 0.0)) for m in g.modules] or [
            ("recorded" if not through_runtime else "no module", 0.0)
        ]
        status = next((st for st, _ in rows if st not in ("cached", "compiled")), rows[0][0])
        report.rows.append(
            {
                "graph": _label(g.key),
                "shapes": "x".join(map(str, g.shapes.get("input_ids", []))) or "-",
                "graph_id": g.graph_id,
                "modules": g.modules,
                "status": status,
                "seconds": round(sum(sec for _, sec in rows), 3),
                "trace_seconds": g.trace_seconds,
            }
        )
    report.seconds = time.perf_counter() - start
    return report


def _preflight_record(backend: Backend, extractor: Extractor) -> GraphRecord:
    """The preflight's device checks compile graphs of their own before training: extract them too (their
    results are meaningless in extraction mode and ignored)."""
    t0 = time.perf_counter()
    modules = extractor.extract(lambda: (device_checks(backend, None), backend.sync()))
    return GraphRecord(["preflight"], {}, "", "", 0, round(time.perf_counter() - t0, 4), modules)
