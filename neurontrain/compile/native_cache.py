"""The native backend's compile cache: PyTorch's portable compile artifacts for a plan's graphs, kept as one
verified entry of the compile cache.

`torch.compiler.save_cache_artifacts()` serializes what inductor and AOTAutograd wrote to (or read from) their
caches in this process; `torch.compiler.load_cache_artifacts(bytes)` puts them back into a fresh process's
caches, where the compiles of the same graphs then hit. The entry's name is ours: the plan's id (recipe
fingerprint, planned graph keys, steps, workers), torch's version, the device and compiler, the machine and the
Python version. Inductor's own cache keys are never computed here: a graph that differs simply misses.

Entry layout (a directory entry of the store, compile/store.py):
  native/<recipe>-<key>/artifacts.bin           the bytes of save_cache_artifacts()
  native/<recipe>-<key>/entry.json              what the entry holds (plan id, graph keys, versions)
  native/<recipe>-<key>/.neurontrain-entry.json sha256 and size of both files: checked before loading

On TorchNeuron (device `neuron`) the entry also carries the NEFF cache directory as `neff.tar`
(compile/neff_cache.py): restored into TORCH_NEURONX_NEFF_CACHE_DIR before the first compile.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neurontrain.compile.cache import Cache
from neurontrain.compile.discover import run_plan_id
from neurontrain.compile.neff_cache import NEFF_ARCHIVE, neff_files, point_neff_cache, restore_neffs
from neurontrain.compile.store import ENTRY_RECORD, LocalEntry, sha256_file
from neurontrain.logs import get_logger
from neurontrain.plan.planning import RunPlan

log = get_logger(__name__)

NATIVE_DIR = "native"
ARTIFACTS = "artifacts.bin"
META = "entry.json"
# TorchDynamo's graphs that AOTAutograd took from its cache / compiled (one per graph: forward and backward
# together), and inductor's FX graphs (forward and backward apart) likewise; bypass: not cacheable
COUNTERS = (
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
    ("aot_autograd", "autograd_cache_bypass"),
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
    ("inductor", "fxgraph_cache_bypass"),
)


def native_entry_key(plan_id: str, torch_version: str, device_type: str, compiler: str, machine: str) -> str:
    """Our name for a plan's artifacts: everything that changes the compiled graphs, hashed (pure)."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    payload = json.dumps([plan_id, torch_version, device_type, compiler, machine, python])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def native_entry_path(plan: RunPlan, device_type: str, compiler: str) -> str:
    """`native/<recipe>-<key>`: the entry of this plan's artifacts, relative to the cache root."""
    import torch  # lazy: only the native backend's cache needs torch's version

    key = native_entry_key(run_plan_id(plan, "native"), torch.__version__, device_type, compiler, platform.machine())
    return f"{NATIVE_DIR}/{plan.recipe.name}-{key}"


def cache_counts(counters: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """The cache counters of AOTAutograd and inductor (pure, over torch._dynamo.utils.counters)."""
    return {name: int(counters.get(group, {}).get(name, 0)) for group, name in COUNTERS}


def counts_now() -> dict[str, int]:
    from torch._dynamo.utils import counters  # lazy: TorchDynamo loads in seconds; native only

    return cache_counts(counters)


def counts_since(before: dict[str, int]) -> dict[str, int]:
    now = counts_now()
    return {k: now[k] - before.get(k, 0) for k in now}


def write_entry(root: Path, path: str, artifacts: bytes, meta: dict, neffs: bytes | None = None) -> Path:
    """Write the entry with its sha256 record, atomically (a directory renamed into place); replaces one there.
    neffs: TorchNeuron's NEFF cache directory as an archive (compile/neff_cache.py)."""
    final = root / path
    staging = root / NATIVE_DIR / f".write-{uuid.uuid4().hex}"
    staging.mkdir(parents=True)
    (staging / ARTIFACTS).write_bytes(artifacts)
    if neffs is not None:
        (staging / NEFF_ARCHIVE).write_bytes(neffs)
    (staging / META).write_text(json.dumps(meta, indent=2))
    record = LocalEntry(path, staging, False).record()
    (staging / ENTRY_RECORD).write_text(json.dumps(record))
    if final.exists():
        shutil.rmtree(final)
    os.rename(staging, final)
    return final


def entry_problem(location: Path) -> str | None:
    """Why an entry directory must not be loaded (missing, no record, a file whose size or sha256 differs from
    its record), or None when every file matches its record."""
    record_file = location / ENTRY_RECORD
    if not (location / ARTIFACTS).is_file():
        return f"{ARTIFACTS} missing"
    if not record_file.is_file():
        return f"no sha256 record ({ENTRY_RECORD})"
    try:
        files = json.loads(record_file.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"unreadable sha256 record ({ENTRY_RECORD})"
    if ARTIFACTS not in files:
        return f"the sha256 record does not name {ARTIFACTS}"
    for name, want in files.items():
        p = location / name
        if not p.is_file():
            return f"{name} missing"
        if p.stat().st_size != want.get("size"):
            return f"{name} truncated or extended ({p.stat().st_size} of {want.get('size')} bytes)"
        if sha256_file(p) != want.get("sha256"):
            return f"{name} altered (sha256 mismatch)"
    return None


@dataclass
class NativeLoad:
    """What run did with the entry before its first compile."""

    entry: str
    loaded: bool = False
    refused: str | None = None  # why the entry was not loaded, when it was there and failed its check
    artifacts: int = 0  # artifacts PyTorch put back into its caches

    def to_json(self) -> dict[str, Any]:
        return {"entry": self.entry, "loaded": self.loaded, "refused": self.refused, "artifacts": self.artifacts}


def load_entry(root: Path, path: str) -> NativeLoad:
    """Verify the entry's files against their sha256 record, then hand the artifacts to PyTorch's caches. A
    missing entry loads nothing; a damaged one is refused (and not loaded)."""
    out = NativeLoad(path)
    location = root / path
    if not location.exists():
        return out
    out.refused = entry_problem(location)
    if out.refused is not None:
        return out
    import torch.compiler  # lazy: see counts_now

    info = torch.compiler.load_cache_artifacts((location / ARTIFACTS).read_bytes())
    out.loaded = True
    out.artifacts = sum(len(v) for v in info.artifacts.values()) if info is not None else 0
    return out


@dataclass
class NodeEntry:
    """What one process per node did with the plan's entry before any compile: pulled it from the store (once
    for the node), checked it against its sha256 record and, on TorchNeuron, restored its NEFFs into the node's
    NEFF cache directory (shared by the node's workers)."""

    entry: str
    pulled: dict | None
    refused: str | None = None
    neff_dir: Path | None = None
    neffs_restored: int = 0  # NEFF files the entry's archive brought that were not there

    @classmethod
    def prepare(cls, cache: Cache, path: str, device_type: str) -> NodeEntry:
        neff_dir = point_neff_cache(os.environ, cache.local) if device_type == "neuron" else None
        found = len(neff_files(neff_dir)) if neff_dir is not None else 0
        pulled = cache.pull_paths({path})
        location = cache.local / path
        refused = entry_problem(location) if location.exists() else None
        if refused:
            log.warning(f"compile cache: refused {path}: {refused}; not loaded, the run compiles its graphs")
        elif neff_dir is not None and (location / NEFF_ARCHIVE).is_file():
            restore_neffs(location / NEFF_ARCHIVE, neff_dir)
        restored = len(neff_files(neff_dir)) - found if neff_dir is not None else 0
        return cls(path, pulled, refused, neff_dir, restored)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"entry": self.entry, "refused": self.refused}
        if self.neff_dir is not None:
            out["neff_cache"] = {"dir": str(self.neff_dir), "restored": self.neffs_restored}
        return out


@dataclass
class NativeCacheUse:
    """A native process's use of the compile cache: the entry loaded into PyTorch's caches before the first
    compile (after its node prepared it: `NodeEntry`), and the cache counters from then to the end of the run."""

    load: NativeLoad
    before: dict[str, int]
    neff_dir: Path | None = None  # TorchNeuron: its NEFF cache directory, and the files there at the start
    neffs_before: int = 0

    @classmethod
    def start(cls, cache: Cache, plan: RunPlan, device_type: str, compiler: str) -> NativeCacheUse:
        """Load the plan's entry (pulled and checked by the node: `NodeEntry.prepare`) before the first compile."""
        load = load_entry(cache.local, native_entry_path(plan, device_type, compiler))
        if load.loaded:
            log.info(f"compile cache: loaded {load.artifacts} compile artifacts from {cache.local / load.entry}")
        neff_dir = point_neff_cache(os.environ, cache.local) if device_type == "neuron" else None
        neffs = len(neff_files(neff_dir)) if neff_dir is not None else 0
        return cls(load, counts_now(), neff_dir, neffs)

    def finish(self) -> dict:
        """This process's part of the summary's `compile_cache["native"]`: whether the entry loaded, and the
        counters of the run: graphs_from_cache / graphs_compiled are AOTAutograd's cache hits / misses, one per
        TorchDynamo graph; on TorchNeuron `neff_cache.compiled`, the NEFF files that appeared in the NEFF cache
        directory while it ran (one per forward, backward or inference module TorchNeuron compiled)."""
        counts = counts_since(self.before)
        out = {
            **self.load.to_json(),
            "graphs_from_cache": counts["autograd_cache_hit"],
            "graphs_compiled": counts["autograd_cache_miss"] + counts["autograd_cache_bypass"],
            "counters": counts,
        }
        if self.neff_dir is not None:
            out["neff_cache"] = {"compiled": len(neff_files(self.neff_dir)) - self.neffs_before}
        return out


def single_summary(node: NodeEntry, use: NativeCacheUse) -> dict:
    """`compile_cache["native"]` of a run in one process: the node's part and the process's, merged."""
    out = {**node.to_json(), **use.finish()}
    if node.neff_dir is not None:
        out["neff_cache"] = {**node.to_json()["neff_cache"], **out["neff_cache"]}
    return out


def recipe_entries(local: Path, remote: Mapping[str, float], recipe: str) -> list[dict]:
    """Every native entry of the recipe, local or in the store (other layouts, devices, versions), with the workers
    and device its entry.json records where it is local."""
    prefix = f"{NATIVE_DIR}/{recipe}-"
    names = {f"{NATIVE_DIR}/{d.name}" for d in (local / NATIVE_DIR).glob(f"{recipe}-*") if d.is_dir()}
    names |= {p for p in remote if p.startswith(prefix)}
    out = []
    for name in sorted(names):
        meta_file = local / name / META
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        out.append(
            {
                "entry": name,
                "workers": meta.get("workers", 1 if meta else None),
                "device": meta.get("device", "?"),
                "local": (local / name).is_dir(),
                "remote": name in remote,
            }
        )
    return out


def native_status(plan: RunPlan, cache: Cache, device_type: str, compiler: str) -> dict:
    """`cache status` on native: the plan's artifacts entry, locally (checked against its record) and remotely."""
    path = native_entry_path(plan, device_type, compiler)
    location = cache.local / path
    remote = cache.remote.list_entries() if cache.remote is not None else {}
    out = {
        "recipe": plan.recipe.name,
        "plan_id": run_plan_id(plan, "native"),
        "backend": "native",
        "entry": path,
        "planned_graphs": [list(k) for k in plan.expected_graphs()],
        "local": location.exists(),
        "local_problem": entry_problem(location) if location.exists() else None,
        "remote": path in remote if cache.remote is not None else None,
    }
    if out["local"] and (location / META).is_file():
        out["entry_graphs"] = json.loads((location / META).read_text()).get("graphs", [])
    out["recipe_entries"] = recipe_entries(cache.local, remote, plan.recipe.name)
    if not out["local"] and not out["remote"]:
        out["note"] = "no artifacts for this plan: run `neurontrain precompile --backend native` with the same recipe"
    return out
