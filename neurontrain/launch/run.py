"""`neurontrain run`: one process, or this node's workers under torchrun, or one of those workers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from neurontrain.errors import UsageError
from neurontrain.launch.topology import Topology
from neurontrain.loop.metrics import write_summary

SUMMARY_KEYS = ("backend", "steps", "world_size", "effective_batch", "restarts", "first_loss", "final_loss",
                "compilations", "distinct_graphs", "unexpected_graphs", "tokens_per_second", "padding_fraction",
                "wall_seconds")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data-parallel workers (torchrun)")
    g.add_argument("--nproc-per-node", type=int, help="workers on this node (launches through torchrun)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    g.add_argument("--node-rank", type=int, default=0, help="this node's rank (static rendezvous)")
    g.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (static rendezvous)")
    g.add_argument("--master-port", type=int, default=29500)
    g.add_argument("--rdzv-endpoint", help="HOST:PORT of a c10d rendezvous instead of the static one")
    g.add_argument("--rdzv-id", help="job id shared by all nodes of a c10d rendezvous")
    g.add_argument("--rdzv-timeout", type=int, default=900, help="seconds to wait for all nodes (default 900)")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="restart the workers this often after a failure; they resume from the latest checkpoint")


def topology_from(args: argparse.Namespace) -> Topology:
    return Topology(args.nproc_per_node or 1, args.nnodes, args.node_rank, args.master_addr, args.master_port,
                    args.max_restarts, args.rdzv_endpoint, args.rdzv_id, args.rdzv_timeout).validate()


def cmd_run(args: argparse.Namespace) -> int:
    from neurontrain.backend import resolve_backend_name
    from neurontrain.launch.elastic import in_worker
    from neurontrain.loop.planning import make_plan
    from neurontrain.recipe import load_recipe

    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f"runtime.backend={args.backend}")
    recipe = load_recipe(args.recipe, overrides)
    output_dir = Path(args.output_dir or Path("runs") / recipe.name)
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output-dir {output_dir} exists and is not a directory")
    if in_worker():
        return _worker(args, recipe, output_dir)
    topology = topology_from(args)
    launching = args.nproc_per_node is not None or topology.nnodes > 1 or topology.max_restarts > 0
    world = topology.world if launching else 1
    if args.dry_run:
        plan = make_plan(recipe, resolve_backend_name(recipe.runtime.backend), world=world)
        print(json.dumps(plan.describe(), indent=2))
        return 0
    if launching:
        return _launch(args, recipe, output_dir, topology)
    return _single(args, recipe, output_dir)


def _announce(plan, backend: str, output_dir: Path) -> None:
    described = plan.describe()
    workers = f", {plan.world} workers x batch {described['per_worker_batch']} x accumulation " \
              f"{described['grad_accum']} = {described['effective_batch']} a step" if plan.world > 1 else ""
    print(f"neurontrain: {plan.recipe.name} on {backend}: {plan.recipe.train.max_steps} steps{workers}, buckets "
          f"{described['buckets']['used']} ({plan.bucket_mode}), {len(described['expected_graphs'])} planned graphs, "
          f"output {output_dir}", file=sys.stderr)


def _manifest_ids(plan, backend: str, cache_local: Path) -> set[str] | None:
    from neurontrain.compile.discover import run_plan_id
    from neurontrain.compile.manifest import load_manifest, manifest_path

    manifest = load_manifest(manifest_path(cache_local, plan.recipe.name, run_plan_id(plan, backend)))
    if manifest is None:
        return None
    print(f"neurontrain: checking graphs against the precompile manifest ({len(manifest.graphs)} graphs)",
          file=sys.stderr)
    return manifest.graph_ids()


def _print_summary(summary: dict) -> None:
    print(json.dumps({k: summary.get(k) for k in SUMMARY_KEYS}))


def _single(args: argparse.Namespace, recipe, output_dir: Path) -> int:
    from neurontrain.backend import backend_for
    from neurontrain.compile.cache import resolve_cache
    from neurontrain.compile.discover import run_plan_id
    from neurontrain.compile.neuron_runtime import attach_runtime
    from neurontrain.compile.runtime_cache import scan_modules
    from neurontrain.health.preflight import preflight
    from neurontrain.loop.dataparallel import DataParallel
    from neurontrain.loop.planning import make_plan
    from neurontrain.loop.trainer import Trainer

    backend = backend_for(recipe.runtime)
    cache = resolve_cache(recipe.runtime.compile_cache)
    location = attach_runtime(cache, recipe.runtime)
    _say_extraction()
    plan = make_plan(recipe, backend.name)
    pulled = cache.pull_before(recipe.name, run_plan_id(plan, backend.name))
    modules_before = scan_modules(Path(location.root)) if location is not None and location.is_local else None
    if recipe.runtime.preflight and not args.no_preflight:
        preflight(backend, recipe, DataParallel())
    _announce(plan, backend.name, output_dir)
    trainer = Trainer(plan, backend, output_dir, _manifest_ids(plan, backend.name, cache.local))
    summary = trainer.run()
    pushed = cache.push_after()
    extra = {}
    if pulled is not None or pushed is not None:
        extra["compile_cache"] = {"pulled": pulled, "pushed": pushed}
    if location is not None:
        extra["neuron_cache"] = neuron_cache_counters(location, modules_before, summary["compilations"])
    if extra and not trainer.extracting:
        summary.update(extra)
        write_summary(output_dir, summary)
    _print_summary(summary)
    return 0


def neuron_cache_counters(location, before: dict | None, compilations: int) -> dict:
    """Graphs the runtime compiled during the run (modules that gained a NEFF) and graphs it loaded from its
    cache (the run's compilations less those)."""
    from neurontrain.compile.runtime_cache import gained_neff, scan_modules

    out = {"root": location.root, "source": location.source}
    if before is not None:
        compiled = gained_neff(before, scan_modules(Path(location.root)))
        out.update(compiled_at_run_time=len(compiled), cache_hits=max(compilations - len(compiled), 0),
                   modules_compiled=compiled)
    return out


def _say_extraction() -> None:
    from neurontrain.compile.runtime_cache import extraction_mode

    if extraction_mode():
        print("neurontrain: NEURON_EXTRACT_GRAPHS_ONLY is set: the runtime only extracts graphs and every value "
              "is fake, so this run writes no checkpoint, model, metrics or summary", file=sys.stderr)


def _launch(args: argparse.Namespace, recipe, output_dir: Path, topology: Topology) -> int:
    """Validate the whole job here (bad input exits 2 before any worker starts), pull the compile cache once
    for the node, start the workers, push after."""
    from neurontrain.backend import resolve_backend_name
    from neurontrain.compile.cache import resolve_cache
    from neurontrain.compile.discover import run_plan_id
    from neurontrain.compile.neuron_runtime import attach_runtime
    from neurontrain.compile.runtime_cache import scan_modules
    from neurontrain.launch.elastic import check_master_address, launch, worker_argv
    from neurontrain.loop.planning import make_plan

    check_master_address(topology)
    backend = resolve_backend_name(recipe.runtime.backend)
    plan = make_plan(recipe, backend, world=topology.world)
    _announce(plan, backend, output_dir)
    cache = resolve_cache(recipe.runtime.compile_cache)
    location = attach_runtime(cache, recipe.runtime)  # exported to the workers through the environment
    _say_extraction()
    cache.pull_before(recipe.name, run_plan_id(plan, backend))
    modules_before = scan_modules(Path(location.root)) if location is not None and location.is_local else None
    launch(topology, worker_argv(args.recipe, str(output_dir), list(args.overrides), args.backend, args.no_preflight))
    cache.push_after()
    summary_file = output_dir / "summary.json"
    if topology.node_rank == 0 and summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        if location is not None:
            summary["neuron_cache"] = neuron_cache_counters(location, modules_before, summary["compilations"])
            write_summary(output_dir, summary)
        _print_summary(summary)
    return 0


def _worker(args: argparse.Namespace, recipe, output_dir: Path) -> int:
    from neurontrain.backend import backend_for
    from neurontrain.compile.cache import resolve_cache
    from neurontrain.compile.neuron_runtime import attach_runtime
    from neurontrain.health.preflight import preflight
    from neurontrain.loop.dataparallel import DataParallel
    from neurontrain.loop.planning import make_plan
    from neurontrain.loop.trainer import Trainer

    dp = DataParallel.from_env()
    backend = backend_for(recipe.runtime)
    cache = resolve_cache(recipe.runtime.compile_cache)
    attach_runtime(cache, recipe.runtime)
    dp.start(backend, recipe.runtime.collective_timeout)
    try:
        if recipe.runtime.preflight and not args.no_preflight:
            preflight(backend, recipe, dp, output_dir)
        plan = make_plan(recipe, backend.name, world=dp.world)
        manifest = _manifest_ids(plan, backend.name, cache.local) if dp.is_master else None
        if dp.enabled:
            manifest = dp.all_gather_object(manifest)[0]
        Trainer(plan, backend, output_dir, manifest, dp).run()
    finally:
        dp.close()
    return 0
