"""`neurontrain cache ...` and the cache handling of `run`/`precompile`: a local directory, optionally
backed by an s3:// store that is pulled before and pushed after (by one process per node)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from neurontrain.compile.discover import run_plan_id
from neurontrain.compile.manifest import load_manifest, manifest_path
from neurontrain.compile.s3 import S3Store
from neurontrain.compile.store import local_entries, parse_duration, remove_entry, verify_local
from neurontrain.errors import UsageError
from neurontrain.logs import get_logger
from neurontrain.plan.planning import make_plan

log = get_logger(__name__)


def default_local() -> Path:
    """The local cache that mirrors an s3:// cache: NEURONTRAIN_CACHE_DIR, else compile_cache/ here."""
    return Path(os.environ.get("NEURONTRAIN_CACHE_DIR") or "compile_cache")


def _node_leader() -> bool:
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


@dataclass
class Cache:
    local: Path
    remote: S3Store | None = None

    def pull_before(self, recipe_name: str, plan_id: str) -> dict | None:
        """Fetch this plan's manifest, then the graphs and compiled modules it names (not the whole store)."""
        if self.remote is None or not _node_leader():
            return None
        path = manifest_path(self.local, recipe_name, plan_id)
        wanted = {f"manifests/{path.name}"}
        report = self.remote.pull(self.local, only=wanted)
        manifest = load_manifest(path)
        if manifest is not None:
            ids, modules = manifest.graph_ids(), set(manifest.module_names())
            remote = self.remote.list_entries()
            wanted = {p for p in remote if (p.startswith("graphs/") and p.split("/")[1] in ids) or p in modules}
            more = self.remote.pull(self.local, only=wanted)
            report.entries += more.entries
            report.bytes += more.bytes
            report.refused += more.refused
        log.info(
            f"pulled {report.entries} entries ({report.bytes} bytes) from {self.remote.url}"
            + (
                f"; refused {len(report.refused)}: "
                + "; ".join(f"{p['entry']}/{p['file']}: {p['problem']}" for p in report.refused)
                if report.refused
                else ""
            )
        )
        return report.to_json()

    def pull_paths(self, paths: set[str]) -> dict | None:
        """Fetch these entries (verified) from the s3:// store where they are missing locally."""
        if self.remote is None or not _node_leader():
            return None
        report = self.remote.pull(self.local, only=paths)
        log.info(
            f"pulled {report.entries} entries ({report.bytes} bytes) from {self.remote.url}"
            + "".join(f"; refused {p['entry']}/{p['file']}: {p['problem']}" for p in report.refused)
        )
        return report.to_json()

    def push_after(self) -> dict | None:
        if self.remote is None or not _node_leader():
            return None
        report = self.remote.push(self.local)
        log.info(
            f"pushed {report.entries} entries ({report.objects} objects, {report.bytes} bytes) to {self.remote.url}"
        )
        return report.to_json()


def resolve_cache(url: str | None, local: str | None = None, workers: int = 8) -> Cache:
    """A local path is the cache itself; s3://bucket/prefix is a remote store mirrored in `local`
    (default compile_cache/ in the working directory)."""
    if url and url.startswith("s3://"):
        return Cache(Path(local) if local else default_local(), S3Store(url, workers=workers))
    if url and "://" in url:
        raise UsageError(f"bad cache URL {url!r} (expected a local directory or s3://bucket/prefix)")
    return Cache(Path(local or url) if (local or url) else default_local())


def cache_status(recipe, cache: Cache, backend_name: str) -> dict:
    """Which of the recipe's graphs are present, from its precompile manifest (local, or pulled from the store)."""
    plan = make_plan(recipe, backend_name)
    pid = run_plan_id(plan, backend_name)
    path = manifest_path(cache.local, recipe.name, pid)
    remote_entries = cache.remote.list_entries() if cache.remote is not None else {}
    if not path.is_file() and f"manifests/{path.name}" in remote_entries:
        cache.remote.pull(cache.local, only={f"manifests/{path.name}"})
    manifest = load_manifest(path)
    out = {
        "recipe": recipe.name,
        "plan_id": pid,
        "backend": backend_name,
        "manifest": str(path),
        "planned_graphs": [list(k) for k in plan.expected_graphs()],
        "graphs": [],
    }
    if manifest is None:
        out["note"] = "no manifest for this plan: run `neurontrain precompile` with the same recipe and overrides"
        return out
    local = local_entries(cache.local)
    for g in manifest.graphs:
        where = []
        if g.hlo_file and (cache.local / g.hlo_file).is_file():
            where.append("local")
        if f"graphs/{g.graph_id}" in remote_entries:
            where.append("remote")
        modules = {
            m: [w for w, present in (("local", m in local), ("remote", m in remote_entries)) if present]
            for m in g.modules
        }
        out["graphs"].append(
            {
                "key": g.key,
                "graph_id": g.graph_id,
                "hlo": where,
                "modules": modules,
                "compiled": bool(modules) and all(modules.values()),
            }
        )
    return out


def prune_local(root: Path, older_than: str) -> dict:
    cutoff = time.time() - parse_duration(older_than)
    removed = 0
    for entry in local_entries(root).values():
        if entry.mtime() < cutoff:
            remove_entry(entry, root)
            removed += 1
    return {"entries_removed": removed}


def verify(cache: Cache) -> list[dict]:
    return cache.remote.verify() if cache.remote is not None else verify_local(cache.local)


def list_entries(cache: Cache) -> list[dict]:
    if cache.remote is not None:
        cache.remote.check()
        return [
            {"entry": p, "published": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))}
            for p, t in sorted(cache.remote.list_entries().items())
        ]
    rows = []
    for path, entry in local_entries(cache.local).items():
        files = entry.files()
        rows.append(
            {
                "entry": path,
                "files": len(files),
                "bytes": sum(p.stat().st_size for p in files.values()),
                "modified": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry.mtime())),
            }
        )
    return rows
