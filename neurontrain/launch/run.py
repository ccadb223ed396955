"""Training a recipe: in this process, as this node's workers under torchrun, or as one of those workers, each
through the same set-up (`launch/setup.py`).

The launching process pulls the compile cache once for the node before any worker starts and pushes after;
the summary it prints and keeps is a `RunSummary` with the cache counters added.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from neurontrain.backends import Backend, backend_for, resolve_backend_name
from neurontrain.backends.hosts import skip_torch_xla_imports
from neurontrain.checkpoint.initial import InitialCheckpoint
from neurontrain.checkpoint.initial_tp import initial_loaders
from neurontrain.compile.graphs import graph_hlo, graph_id
from neurontrain.compile.runtime_cache import extraction_mode
from neurontrain.data.ray_service import ServedData
from neurontrain.launch.elastic import check_master_address, launch
from neurontrain.launch.setup import (
    NodeCache,
    RunSetup,
    announce,
    say_extraction,
    worker_native_cache,
    worker_native_summary,
)
from neurontrain.launch.topology import Topology
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.summary import RunSummary, read_summary
from neurontrain.loop.tp_workers import join_native_mesh, join_tensor_parallel
from neurontrain.loop.trainer import BatchSource, Trainer
from neurontrain.plan.planning import RunPlan
from neurontrain.recipe import Recipe


def train_single(
    recipe: Recipe, output_dir: Path, *, preflight_check: bool, init_from: InitialCheckpoint | None = None
) -> RunSummary:
    """Train in this process; returns the summary (also in output_dir/summary.json unless extracting).
    init_from: a checkpoint to take the starting weights (and optimizer state) from."""
    backend = backend_for(recipe.runtime)
    setup = RunSetup(recipe, backend.name)
    say_extraction()
    plan = setup.plan()
    node = NodeCache.start(setup, plan, backend)
    dp = DataParallel()
    dp.start(backend, recipe.runtime.collective_timeout)  # a process group of one where the device needs it
    setup.preflight(backend, dp, output_dir, preflight_check)
    announce(plan, backend.name, output_dir)
    summary = _trainer(plan, backend, output_dir, setup.manifest(plan, dp), dp, init_from).run()
    dp.close()
    if node.finish(summary, cache_counters=True) and not extraction_mode():
        summary.write(output_dir)
    return summary


@contextmanager
def host_side_imports() -> Iterator[None]:
    """The launching process never touches a device (`skip_torch_xla_imports` while it plans); the workers it
    starts do not inherit the setting."""
    given = os.environ.get("USE_TORCH_XLA")
    skip_torch_xla_imports()
    try:
        yield
    finally:
        if given is None:
            os.environ.pop("USE_TORCH_XLA", None)


def train_workers(recipe: Recipe, output_dir: Path, topology: Topology, worker_argv: list[str]) -> RunSummary | None:
    """Start this node's workers (`python -m neurontrain <worker_argv>`) and wait for them. Validates the whole
    job first (bad input exits 2 before any worker starts). Returns the summary on node 0."""
    check_master_address(topology)
    setup = RunSetup(recipe, resolve_backend_name(recipe.runtime.backend))
    say_extraction()
    with host_side_imports():
        plan = setup.plan(world=topology.world)
        announce(plan, setup.backend, output_dir)
        node = NodeCache.start(setup, plan)
    launch(topology, worker_argv)
    summary = read_summary(output_dir) if topology.node_rank == 0 else None
    changed = node.finish(summary, cache_counters=False)
    if summary is not None and plan.data.store.get("tokenized_documents"):
        summary.data, changed = plan.data.store, True  # this process tokenized for the node; the workers mapped it
    if changed:
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
    setup = RunSetup(recipe, backend.name)
    dp.start(backend, recipe.runtime.collective_timeout)
    try:
        setup.preflight(backend, dp, output_dir, preflight_check)
        plan = setup.plan(world=dp.world, data=service.lengths if service else None)
        manifest = setup.manifest(plan, dp)
        workers = _data_parallel_view(dp, plan, backend)  # the trainer sees the DP group
        source = service.source_for(plan.collation(workers.rank)) if service is not None else None
        native = worker_native_cache(setup, plan, backend, dp) if backend.is_native else None
        summary = _trainer(plan, backend, output_dir, manifest, workers, init_from, source).run()
        if native is not None and not extraction_mode():
            worker_native_summary(native, dp, summary, output_dir)
        return summary
    finally:
        dp.close()


def _data_parallel_view(dp: DataParallel, plan: RunPlan, backend: Backend) -> DataParallel:
    """Under tensor parallel, this worker's data-parallel group (NxD's groups; native: a [dp, tp] mesh)."""
    if plan.tp == 1:
        return dp
    if backend.is_native:
        return join_native_mesh(dp, plan.tp, backend.device.type)
    return join_tensor_parallel(dp, plan.tp)


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
