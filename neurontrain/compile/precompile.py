"""`neurontrain precompile`: discover a recipe's graphs, record them, and compile them ahead of time where
the runtime can reuse compiled graphs (Neuron: neuronx-cc into the Neuron persistent cache layout)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from neurontrain.backend import Backend
from neurontrain.compile.neuron import NeuronCompiler
from neurontrain.compile.manifest import Manifest, manifest_path, save_manifest
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
        lines = [f"{'graph':<22} {'shapes':<22} {'graph id':<18} {'status':<10} {'seconds':>8}"]
        for row in self.rows:
            lines.append(f"{row['graph']:<22} {row['shapes']:<22} {row['graph_id'][:16]:<18} {row['status']:<10} "
                         f"{row['seconds']:>8.2f}")
        lines.append(f"graphs found {self.found}, already cached {self.cached}, compiled {self.compiled}, "
                     f"failed {self.failed}, {self.seconds:.1f} s (discovery {self.manifest.discovery_seconds:.2f} s)")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"target": self.target, "manifest": str(self.manifest_file), "graphs_found": self.found,
                "already_cached": self.cached, "compiled": self.compiled, "failed": self.failed,
                "seconds": round(self.seconds, 3), "discovery_seconds": self.manifest.discovery_seconds,
                "graphs": self.rows, "note": self.note}


def _label(key: list) -> str:
    return key[0] if len(key) == 1 else f"{key[0]} {key[1]}"


def precompile(plan: RunPlan, backend: Backend, cache_root: Path,
               compiler: "NeuronCompiler | None" = None) -> PrecompileReport:
    """With a compiler, graphs are compiled with neuronx-cc into the Neuron cache layout; else recorded only."""
    from neurontrain.compile.discover import discover

    start = time.perf_counter()
    manifest = discover(plan, backend, cache_root)
    path = manifest_path(cache_root, plan.recipe.name, manifest.plan_id)
    save_manifest(path, manifest)
    report = PrecompileReport(manifest, path, "neuron" if compiler else "none", found=len(manifest.graphs))
    statuses: dict[str, tuple[str, float]] = {}
    if compiler is not None:
        unique = {g.graph_id: g for g in manifest.graphs}
        results = compiler.compile_all([(g.graph_id, cache_root / g.hlo_file) for g in unique.values()])
        for res in results:
            statuses[res.graph_id] = (res.status, res.seconds)
        report.cached = sum(1 for r in results if r.status == "cached")
        report.compiled = sum(1 for r in results if r.status == "compiled")
        report.failed = sum(1 for r in results if r.status == "failed")
    else:
        report.note = (f"{backend.name}: graphs recorded in the manifest; this runtime cannot reload compiled "
                       "executables across processes, so compilation happens at run time.")
    for g in manifest.graphs:
        status, seconds = statuses.get(g.graph_id, ("recorded", 0.0))
        report.rows.append({"graph": _label(g.key), "shapes": "x".join(map(str, g.shapes.get("input_ids", []))) or "-",
                            "graph_id": g.graph_id, "status": status, "seconds": seconds,
                            "trace_seconds": g.trace_seconds})
    report.seconds = time.perf_counter() - start
    return report

