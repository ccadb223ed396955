"""The precompile manifest: every graph a recipe's run executes, with its shapes, content id and HLO file.

Pure logic and JSON files; no torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from neurontrain.errors import UsageError
from neurontrain.fileio import write_json_atomic

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class GraphRecord:
    key: list  # ["train", 64], ["eval", 128], ["setup"], ["optimizer"], ["train-micro", 64]
    shapes: dict  # input shapes of the step, e.g. {"input_ids": [16, 64]}
    graph_id: str  # SHA-256 (32 hex) of the HLO text, see compile/graphs.py
    hlo_file: str  # relative to the cache root: graphs/<graph_id>/model.hlo_module.pb
    hlo_bytes: int
    trace_seconds: float
    # the Neuron runtime's module directories for this graph ("neuronxcc-<v>/MODULE_<key>+<flags>"), as the
    # runtime named them when it extracted the graph; empty where no Neuron runtime is installed
    modules: list = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.key[0]


@dataclass
class Manifest:
    recipe: str
    plan_id: str
    backend: str
    graphs: list[GraphRecord] = field(default_factory=list)
    discovery_seconds: float = 0.0
    versions: dict = field(default_factory=dict)

    def graph_ids(self) -> set[str]:
        return {g.graph_id for g in self.graphs}

    def module_names(self) -> list[str]:
        return sorted({m for g in self.graphs for m in g.modules})

    def to_json(self) -> dict:
        return {
            "version": MANIFEST_VERSION,
            "recipe": self.recipe,
            "plan_id": self.plan_id,
            "backend": self.backend,
            "discovery_seconds": self.discovery_seconds,
            "versions": self.versions,
            "graphs": [asdict(g) for g in self.graphs],
        }

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        if data.get("version") != MANIFEST_VERSION:
            raise UsageError(f"manifest version {data.get('version')!r} is not {MANIFEST_VERSION}")
        return cls(
            data["recipe"],
            data["plan_id"],
            data["backend"],
            [GraphRecord(**g) for g in data["graphs"]],
            data.get("discovery_seconds", 0.0),
            data.get("versions", {}),
        )


def plan_id(recipe_fingerprint: str, backend: str, max_steps: int, graph_keys: list[tuple]) -> str:
    """Identity of a run's graph set: the recipe's computation, the backend, and the planned graph keys."""
    payload = json.dumps([recipe_fingerprint, backend, max_steps, [list(k) for k in graph_keys]])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def manifest_path(cache_root: Path, recipe_name: str, plan: str) -> Path:
    return cache_root / "manifests" / f"{recipe_name}-{plan}.json"


def save_manifest(path: Path, manifest: Manifest) -> None:
    write_json_atomic(path, manifest.to_json())


def load_manifest(path: Path) -> Manifest | None:
    if not path.is_file():
        return None
    try:
        return Manifest.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UsageError(
            f"manifest {path} is unreadable ({type(exc).__name__}); delete it and run precompile"
        ) from None
