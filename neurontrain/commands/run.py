"""`neurontrain run RECIPE`: train in this process, or launch this node's workers through torchrun (with
--nproc-per-node, --nnodes > 1 or --max-restarts), or, started by torchrun, be one of those workers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from neurontrain.backends import resolve_backend_name
from neurontrain.checkpoint.initial import InitialCheckpoint
from neurontrain.commands.arguments import (
    add_run_arguments,
    options_from,
    recipe_options_given,
    recipe_overrides,
    worker_argv,
)
from neurontrain.data.service import local_cluster_sizes
from neurontrain.errors import UsageError
from neurontrain.launch.elastic import in_worker
from neurontrain.launch.lightning_script import run_lightning
from neurontrain.launch.ray_plan import describe_service
from neurontrain.launch.ray_train import check_ray_options, train_on_ray
from neurontrain.launch.run import train_as_worker, train_single, train_workers
from neurontrain.launch.topology import Topology
from neurontrain.logs import get_logger
from neurontrain.plan.backend_choice import choose_job_backend, cuda_auto_host
from neurontrain.plan.description import describe_plan
from neurontrain.plan.planning import RunPlan, make_plan
from neurontrain.recipe import load_recipe

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)


def topology_from(args: argparse.Namespace) -> Topology:
    return options_from(Topology, args, nproc_per_node=args.nproc_per_node or 1)


def run(args: argparse.Namespace) -> int:
    if args.lightning is not None:
        if args.launcher == "ray" or args.local_cluster:
            raise UsageError("--lightning starts the script through torchrun; --launcher ray takes a RECIPE")
        run_lightning(args.lightning, topology_from(args), recipe_options_given(args))
        return 0
    if args.recipe is None:
        raise UsageError("run needs a RECIPE (or --lightning SCRIPT)")
    recipe = load_recipe(args.recipe, recipe_overrides(args))
    output_dir = Path(args.output_dir or Path("runs") / recipe.name)
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output-dir {output_dir} exists and is not a directory")
    init_from = _initial_checkpoint(args)
    check_ray_options(recipe, args.launcher, args.local_cluster)
    if in_worker():
        train_as_worker(recipe, output_dir, preflight_check=not args.no_preflight, init_from=init_from)
        return 0
    topology = topology_from(args)
    launching = args.nproc_per_node is not None or topology.nnodes > 1 or topology.max_restarts > 0
    launching = launching or args.launcher == "ray"
    choice = None
    if cuda_auto_host(recipe.runtime.backend):  # eager or native: the whole job's priced time decides
        choice = choose_job_backend(recipe, world=topology.world if launching else 1)
        log.info(choice.reason)
        recipe = recipe.model_copy(update={"runtime": recipe.runtime.model_copy(update={"backend": choice.backend})})
        args = argparse.Namespace(**{**vars(args), "backend": choice.backend})  # the workers get it as --backend
    if args.dry_run:
        plan = make_plan(recipe, resolve_backend_name(recipe.runtime.backend), world=topology.world if launching else 1)
        described = describe_plan(plan)
        if choice is not None:
            described["backend_choice"] = choice.reason
        if args.launcher == "ray":
            described["ray"] = describe_service(plan, _local_sizes(args))
        print(json.dumps(described, indent=2))
        _show_memory(plan)
        return 0
    if args.launcher == "ray":
        figures = train_on_ray(
            recipe,
            output_dir,
            topology,
            preflight_check=not args.no_preflight,
            init_from=init_from,
            local_sizes=_local_sizes(args),
        )
        print(json.dumps(figures))
        return 0
    if launching:
        workers = worker_argv(argparse.Namespace(**{**vars(args), "output_dir": str(output_dir)}))
        summary = train_workers(recipe, output_dir, topology, ["run", *workers])
    else:
        summary = train_single(recipe, output_dir, preflight_check=not args.no_preflight, init_from=init_from)
    if summary is not None:
        print(json.dumps(summary.console()))
        log.info(f"a page with its plots: neurontrain report {output_dir} -o {output_dir / 'report.html'}")
    return 0


def _local_sizes(args: argparse.Namespace) -> dict[str, int] | None:
    if args.local_cluster is None:
        return None
    try:
        return local_cluster_sizes(args.local_cluster)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _show_memory(plan: RunPlan) -> None:
    """The per-core memory table, the choice and what it assumed, on stderr."""
    memory = plan.memory
    if memory is None:
        return
    log.info(memory.table())
    log.info(memory.summary())
    if not memory.fits:
        log.info(f"nothing fits at {memory.work.world} worker(s): {memory.advice}")
    for note in memory.notes:
        log.info(note)


def _initial_checkpoint(args: argparse.Namespace) -> InitialCheckpoint | None:
    """--init-from and --init-from-weights-only, checked."""
    if not args.init_from:
        if args.init_from_weights_only:
            raise UsageError("--init-from-weights-only needs --init-from DIR")
        return None
    path = Path(args.init_from)
    if not path.exists():
        raise UsageError(f"--init-from {path} does not exist")
    return InitialCheckpoint(path, weights_only=args.init_from_weights_only)
