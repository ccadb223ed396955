"""A run's set-up, one path for the single run, torchrun's workers and Ray Train's workers (`launch/run.py`,
`launch/ray_train.py`): the compile cache and the Neuron runtime's cache attached, the plan, the preflight, the
precompile manifest's graph ids (`RunSetup`); and what the launching process does for the whole node: pull the
compile cache before any worker starts, push it after, count the runtime's compiles (`NodeCache`).

Each worker plans again rather than loading the launcher's plan: a plan holds the tokenized data and the model
config (a tokenizer, transformers objects), which a worker needs in memory anyway and which do not serialize
into a file a worker could trust across library versions. `make_plan` is deterministic in (recipe, backend,
world, data), so the launcher's plan and each worker's are equal (`tests/unit/test_scaleout_pure.py` checks the
plan made from the served lengths against the one made from the data).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from neurontrain.backends import Backend
from neurontrain.backends.hosts import native_device_type
from neurontrain.backends.native import TARGETS
from neurontrain.compile.cache import Cache, resolve_cache
from neurontrain.compile.discover import run_plan_id
from neurontrain.compile.manifest import load_manifest, manifest_path
from neurontrain.compile.native_cache import NativeCacheUse, NodeEntry, native_entry_path, single_summary
from neurontrain.compile.neuron_runtime import attach_runtime
from neurontrain.compile.runtime_cache import CacheLocation, extraction_mode, gained_neff, scan_modules
from neurontrain.data.sources import PreparedData
from neurontrain.health.preflight import preflight
from neurontrain.logs import get_logger
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.summary import RunSummary
from neurontrain.plan.description import describe_plan
from neurontrain.plan.planning import RunPlan, make_plan
from neurontrain.recipe import Recipe

log = get_logger(__name__)

NODE_PREPARED = "NEURONTRAIN_NATIVE_ENTRY_PREPARED"  # set by the launching process for its workers: the entry


class RunSetup:
    """The steps every process that trains (or launches training) takes, in this order: attach the caches
    (constructor), `plan`, `preflight`, `manifest`."""

    def __init__(self, recipe: Recipe, backend: str) -> None:
        self.recipe, self.backend = recipe, backend
        self.cache: Cache = resolve_cache(recipe.runtime.compile_cache)
        # the runtime cache's location is exported through the environment: the workers inherit it
        self.location: CacheLocation | None = attach_runtime(self.cache, recipe.runtime)

    def plan(self, world: int = 1, data: PreparedData | None = None) -> RunPlan:
        return make_plan(self.recipe, self.backend, world=world, data=data)

    def preflight(self, backend: Backend, dp: DataParallel, output_dir: Path | None, enabled: bool) -> None:
        if self.recipe.runtime.preflight and enabled:
            preflight(backend, self.recipe, dp, output_dir)

    def manifest(self, plan: RunPlan, dp: DataParallel) -> set[str] | None:
        """The precompile manifest's graph ids, read by worker 0 and shared with the others (None: no manifest)."""
        ids = manifest_ids(plan, self.backend, self.cache.local) if dp.is_master else None
        return dp.all_gather_object(ids)[0] if dp.enabled else ids


@dataclass
class NodeCache:
    """The launching process's part: the compile cache pulled once for the node before any worker starts and
    pushed after; on native, the plan's entry pulled, checked and its NEFFs restored for the node (`NodeEntry`),
    and in a run of one process its artifacts loaded too; the Neuron runtime's modules before the run."""

    setup: RunSetup
    pulled: dict | None
    native_node: NodeEntry | None
    native: NativeCacheUse | None
    modules_before: dict | None

    @classmethod
    def start(cls, setup: RunSetup, plan: RunPlan, backend: Backend | None = None) -> NodeCache:
        """backend: the process trains itself (else it launches the node's workers, which load the entry)."""
        node = native = None
        if setup.backend == "native":
            target = TARGETS[native_device_type()]
            device, compiler = (backend.native_device, backend.compiler) if backend else (target.device_type,
                                                                                      target.compiler)  # fmt: skip
            node = NodeEntry.prepare(setup.cache, native_entry_path(plan, device, compiler), device)
            if backend is not None:
                native = NativeCacheUse.start(setup.cache, plan, device, compiler)
            os.environ[NODE_PREPARED] = node.entry  # the node's workers load it without pulling again
            pulled = node.pulled
        else:
            pulled = setup.cache.pull_before(plan.recipe.name, run_plan_id(plan, setup.backend))
        return cls(setup, pulled, node, native, _modules(setup.location))

    def finish(self, summary: RunSummary | None, *, cache_counters: bool) -> bool:
        """Push the cache; add the Neuron runtime's counters (and, with cache_counters or on native, what was
        pulled and pushed) to `summary`. Whether the summary changed."""
        pushed = self.setup.cache.push_after()
        if summary is None:
            return False
        changed = False
        native = self.native_node is not None
        if (cache_counters or native) and (self.pulled is not None or pushed is not None or native):
            summary.compile_cache = {**(summary.compile_cache or {}), "pulled": self.pulled, "pushed": pushed}
            changed = True
        if self.native is not None:
            summary.compile_cache["native"] = single_summary(self.native_node, self.native)
        elif native:  # the workers' own parts are there already (`worker_native_summary`)
            workers = summary.compile_cache.get("native", {})
            summary.compile_cache["native"] = {**workers, "node": self.native_node.to_json()}
        if self.setup.location is not None:
            summary.neuron_cache = neuron_cache_counters(self.setup.location, self.modules_before, summary.compilations)
            changed = True
        return changed


def worker_native_cache(setup: RunSetup, plan: RunPlan, backend: Backend, dp: DataParallel) -> NativeCacheUse:
    """A native worker's entry, loaded before its first compile. Under our launcher the node has pulled and
    prepared it already; under a torchrun of the user's own, local rank 0 of each node does it while the other
    workers wait at a barrier (one download a node, never one a worker)."""
    path = native_entry_path(plan, backend.native_device, backend.compiler)
    if os.environ.get(NODE_PREPARED) != path:
        if dp.local_rank == 0:
            NodeEntry.prepare(setup.cache, path, backend.native_device)
        dp.barrier()
    return NativeCacheUse.start(setup.cache, plan, backend.native_device, backend.compiler)


def worker_native_summary(use: NativeCacheUse, dp: DataParallel, summary: RunSummary, output_dir: Path) -> None:
    """Every worker's use of the entry, gathered into worker 0's summary (`compile_cache.native.workers`)."""
    mine = {"rank": dp.rank, **use.finish()}
    workers = dp.all_gather_object(mine)
    if dp.is_master:
        native = {"entry": use.load.entry, "workers": workers}
        summary.compile_cache = {**(summary.compile_cache or {}), "native": native}
        summary.write(output_dir)


def neuron_cache_counters(location: CacheLocation, before: dict | None, compilations: int) -> dict:
    """Graphs the runtime compiled during the run (modules that gained a NEFF) and graphs it loaded from its
    cache (the run's compilations less those)."""
    out = {"root": location.root, "source": location.source}
    if before is not None:
        compiled = gained_neff(before, scan_modules(Path(location.root)))
        out.update(
            compiled_at_run_time=len(compiled),
            cache_hits=max(compilations - len(compiled), 0),
            modules_compiled=compiled,
        )
    return out


def _modules(location: CacheLocation | None) -> dict | None:
    return scan_modules(Path(location.root)) if location is not None and location.is_local else None


def announce(plan: RunPlan, backend: str, output_dir: Path) -> None:
    described = describe_plan(plan)
    workers = (
        f", {plan.world} workers x batch {described['per_worker_batch']} x accumulation "
        f"{described['grad_accum']} = {described['effective_batch']} a step"
        if plan.world > 1
        else ""
    )
    log.info(
        f"{plan.recipe.name} on {backend}: {plan.recipe.train.max_steps} steps{workers}, buckets "
        f"{described['buckets']['used']} ({plan.bucket_mode}), {len(described['expected_graphs'])} planned graphs, "
        f"output {output_dir}"
    )
    if plan.memory is not None:
        log.info(plan.memory.summary())


def manifest_ids(plan: RunPlan, backend: str, cache_local: Path) -> set[str] | None:
    manifest = load_manifest(manifest_path(cache_local, plan.recipe.name, run_plan_id(plan, backend)))
    if manifest is None:
        return None
    log.info(f"checking graphs against the precompile manifest ({len(manifest.graphs)} graphs)")
    return manifest.graph_ids()


def say_extraction() -> None:
    if extraction_mode():
        log.info(
            "NEURON_EXTRACT_GRAPHS_ONLY is set: the runtime only extracts graphs and every value is fake, so this "
            "run writes no checkpoint, model, metrics or summary"
        )
