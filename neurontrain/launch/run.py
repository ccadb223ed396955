"""Training a recipe: in this process, as this node's workers under torchrun, or as one of those workers.

The launching process pulls the compile cache once for the node before any worker starts and pushes after;
the summary it prints and keeps is a `RunSummary` with the cache counters added.
"""

from __future__ import annotations

import os
from pathlib import Path

from neurontrain.backends import Backend, backend_for, resolve_backend_name
from neurontrain.backends.hosts import native_device_type
from neurontrain.checkpoint.initial import InitialCheckpoint
from neurontrain.checkpoint.initial_tp import initial_loaders
from neurontrain.compile.cache import resolve_cache
from neurontrain.compile.discover import run_plan_id
from neurontrain.compile.graphs import graph_hlo, graph_id
from neurontrain.compile.manifest import load_manifest, manifest_path
from neurontrain.compile.native_cache import NativeCacheUse
from neurontrain.compile.neff_cache import point_neff_cache
from neurontrain.compile.neuron_runtime import attach_runtime
from neurontrain.compile.runtime_cache import CacheLocation, extraction_mode, gained_neff, scan_modules
from neurontrain.data.ray_service import ServedData
from neurontrain.health.preflight import preflight
from neurontrain.launch.elastic import check_master_address, launch
from neurontrain.launch.topology import Topology
from neurontrain.logs import get_logger
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.plan_description import describe_plan
from neurontrain.loop.planning import RunPlan, make_plan
from neurontrain.loop.summary import RunSummary, read_summary
from neurontrain.loop.tp_workers import join_tensor_parallel
from neurontrain.loop.trainer import BatchSource, Trainer
from neurontrain.recipe import Recipe

log = get_logger(__name__)


def train_single(
    recipe: Recipe, output_dir: Path, *, preflight_check: bool, init_from: InitialCheckpoint | None = None
) -> RunSummary:
    """Train in this process; returns the summary (also in output_dir/summary.json unless extracting).
    init_from: a checkpoint to take the starting weights (and optimizer state) from."""
    backend = backend_for(recipe.runtime)
    cache = resolve_cache(recipe.runtime.compile_cache)
    location = attach_runtime(cache, recipe.runtime)
    _say_extraction()
    plan = make_plan(recipe, backend.name)
    native = NativeCacheUse.start(cache, plan, backend.native_device, backend.compiler) if backend.is_native else None
    pulled = native.pulled if native else cache.pull_before(recipe.name, run_plan_id(plan, backend.name))
    modules_before = _modules(location)
    alone = DataParallel()
    alone.start(backend, recipe.runtime.collective_timeout)  # a process group of one where the device needs it
    if recipe.runtime.preflight and preflight_check:
        preflight(backend, recipe, alone)
    _announce(plan, backend.name, output_dir)
    manifest = _manifest_ids(plan, backend.name, cache.local)
    trainer = _trainer(plan, backend, output_dir, manifest, alone, init_from)
    summary = trainer.run()
    alone.close()
    pushed = cache.push_after()
    changed = False
    if pulled is not None or pushed is not None or native is not None:
        summary.compile_cache, changed = {"pulled": pulled, "pushed": pushed}, True
    if native is not None:
        summary.compile_cache["native"] = native.finish()
    if location is not None:
        summary.neuron_cache, changed = neuron_cache_counters(location, modules_before, summary.compilations), True
    if changed and not extraction_mode():
        summary.write(output_dir)
    return summary


def train_workers(recipe: Recipe, output_dir: Path, topology: Topology, worker_argv: list[str]) -> RunSummary | None:
    """Start this node's workers (`python -m neurontrain <worker_argv>`) and wait for them. Validates the whole
    job first (bad input exits 2 before any worker starts). Returns the summary on node 0."""
    check_master_address(topology)
    backend = resolve_backend_name(recipe.runtime.backend)
    plan = make_plan(recipe, backend, world=topology.world)
    _announce(plan, backend, output_dir)
    cache = resolve_cache(recipe.runtime.compile_cache)
    location = attach_runtime(cache, recipe.runtime)  # exported to the workers through the environment
    if backend == "native" and native_device_type() == "neuron":  # TorchNeuron's NEFFs: under the compile cache
        point_neff_cache(os.environ, cache.local)
    _say_extraction()
    cache.pull_before(recipe.name, run_plan_id(plan, backend))
    modules_before = _modules(location)
    launch(topology, worker_argv)
    cache.push_after()
    summary = read_summary(output_dir) if topology.node_rank == 0 else None
    if summary is not None and location is not None:
        summary.neuron_cache = neuron_cache_counters(location, modules_before, summary.compilations)
        summary.write(output_dir)
    return summary


def train_as_worker(
    recipe: Recipe,
    output_dir: Path,
    *,
    preflight_check: bool,
    init_from: InitialCheckpoint | None = None,
    service: ServedData | None = None,
) -> RunSummary:
    """One worker of a torchrun (or Ray Train) group; the launcher pulled the cache and prints the summary.
    service: the training batches come from a data service; planning uses the lengths it sent."""
    dp = DataParallel.from_env()
    backend = backend_for(recipe.runtime)
    cache = resolve_cache(recipe.runtime.compile_cache)
    attach_runtime(cache, recipe.runtime)
    dp.start(backend, recipe.runtime.collective_timeout)
    try:
        if recipe.runtime.preflight and preflight_check:
            preflight(backend, recipe, dp, output_dir)
        plan = make_plan(recipe, backend.name, world=dp.world, data=service.lengths if service else None)
        manifest = _manifest_ids(plan, backend.name, cache.local) if dp.is_master else None
        if dp.enabled:
            manifest = dp.all_gather_object(manifest)[0]
        workers = join_tensor_parallel(dp, plan.tp) if plan.tp > 1 else dp  # the trainer sees the DP group
        source = service.source_for(plan.collation(workers.rank)) if service is not None else None
        return _trainer(plan, backend, output_dir, manifest, workers, init_from, source).run()
    finally:
        dp.close()


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


def _trainer(
    plan: RunPlan,
    backend: Backend,
    output_dir: Path,
    manifest: set[str] | None,
    dp: DataParallel,
    init_from: InitialCheckpoint | None = None,
    batch_source: BatchSource | None = None,
) -> Trainer:
    return Trainer(
        plan,
        backend,
        output_dir,
        manifest_graphs=manifest,
        dp=dp,
        graph_identifier=lambda tensors: graph_id(graph_hlo(tensors)[0]),
        extracting=extraction_mode(),
        batch_source=batch_source,
        **({} if init_from is None else initial_loaders(init_from, dp)),
    )


def _announce(plan: RunPlan, backend: str, output_dir: Path) -> None:
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


def _manifest_ids(plan: RunPlan, backend: str, cache_local: Path) -> set[str] | None:
    manifest = load_manifest(manifest_path(cache_local, plan.recipe.name, run_plan_id(plan, backend)))
    if manifest is None:
        return None
    log.info(f"checking graphs against the precompile manifest ({len(manifest.graphs)} graphs)")
    return manifest.graph_ids()


def _say_extraction() -> None:
    if extraction_mode():
        log.info(
            "NEURON_EXTRACT_GRAPHS_ONLY is set: the runtime only extracts graphs and every value is fake, so this "
            "run writes no checkpoint, model, metrics or summary"
        )
