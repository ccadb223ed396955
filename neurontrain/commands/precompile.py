"""`neurontrain precompile RECIPE`: discover the recipe's graphs and compile them ahead of time."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from neurontrain.backends import backend_for, neuron_runtime_present
from neurontrain.commands.arguments import add_recipe_arguments, recipe_overrides
from neurontrain.compile.cache import Cache, resolve_cache
from neurontrain.compile.discover import run_plan_id
from neurontrain.compile.native_cache import native_entry_path
from neurontrain.compile.native_precompile import check_native_precompile, precompile_native
from neurontrain.compile.neuron_runtime import attach_runtime, check_precompile_location, describe_location
from neurontrain.compile.precompile import precompile
from neurontrain.errors import UsageError
from neurontrain.fileio import write_json_atomic
from neurontrain.logs import get_logger
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import Recipe, load_recipe

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser, eager=False, required=False)
    parser.add_argument(
        "--lightning",
        metavar='"SCRIPT:FUNCTION [ARGS]"',
        help="precompile a Lightning script instead of a recipe: FUNCTION returns (module, datamodule, Trainer "
        "kwargs with neurontrain.lightning.trainer_args()); a short fit visits every bucket and a checkpoint",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="parallel compiler processes (default: one per 64 GiB of host memory, rounded up, at least 1, "
        "as neuron_parallel_compile picks)",
    )
    parser.add_argument("--cache", help="local cache directory or s3://bucket/prefix (default: runtime.compile_cache)")
    parser.add_argument(
        "--local",
        help="local directory that mirrors an s3:// cache (default: $NEURONTRAIN_CACHE_DIR or compile_cache)",
    )
    parser.add_argument(
        "--target",
        choices=["auto", "neuron", "none"],
        default="auto",
        help="neuron: the Neuron runtime extracts and compiles every graph into its cache (default where the "
        "runtime is installed); none: record the graphs only",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="retries of a failed compile by the runtime (NEURON_PARALLEL_COMPILE_MAX_RETRIES)",
    )
    parser.add_argument("--json", dest="json_file", help="also write the report as JSON to this file")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="plan for this many workers per node")
    parser.add_argument("--nnodes", type=int, default=1, help="plan for this many nodes")


def _check_bounds(args: argparse.Namespace) -> None:
    if args.workers is not None and args.workers < 1:
        raise UsageError("--workers must be at least 1")
    if args.retries < 0:
        raise UsageError("--retries must be 0 or more")
    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise UsageError("--nproc-per-node and --nnodes must be at least 1")


def run(args: argparse.Namespace) -> int:
    _check_bounds(args)
    if args.lightning is not None:
        return _precompile_lightning(args)
    if args.recipe is None:
        raise UsageError("precompile needs a RECIPE (or --lightning SCRIPT:FUNCTION)")
    recipe = load_recipe(args.recipe, recipe_overrides(args))
    cache = resolve_cache(args.cache or recipe.runtime.compile_cache, args.local)
    if recipe.runtime.backend == "native":
        return _precompile_native(args, recipe, cache)
    backend = backend_for(recipe.runtime)
    target = args.target if args.target != "auto" else ("neuron" if neuron_runtime_present() else "none")
    if target == "neuron" and not neuron_runtime_present():
        raise UsageError("--target neuron needs the Neuron runtime (libneuronxla, installed with torch-neuronx)")
    location = attach_runtime(cache, recipe.runtime) if target == "neuron" else None
    check_precompile_location(location)
    if location is not None:
        os.environ.setdefault("NEURON_PARALLEL_COMPILE_MAX_RETRIES", str(args.retries))
        log.info(f"Neuron runtime cache: {describe_location(location)}")
    plan = make_plan(recipe, backend.name, world=args.nproc_per_node * args.nnodes)
    extract_instead = (
        "Extract them with the runtime instead: neuron_parallel_compile neurontrain run RECIPE --nproc-per-node N "
        "--set train.max_steps=K (run keeps nothing under extraction)"
    )
    if plan.tp > 1:
        raise UsageError(
            f"parallel.tp: {plan.tp}: each tensor-parallel rank's graphs hold collectives over its group, which one "
            f"process cannot trace (not built yet). {extract_instead}"
        )
    if plan.world > 1 and not plan.host_reduce:
        raise UsageError(
            f"{backend.name} reduces gradients inside the step graph: its data-parallel graphs hold a collective "
            f"over {plan.world} workers, which one process cannot trace (not built yet). {extract_instead}"
        )
    cache.pull_before(recipe.name, run_plan_id(plan, backend.name))
    report = precompile(plan, backend, cache.local, through_runtime=target == "neuron", workers=args.workers)
    log.info(report.table())  # the report for people; stdout keeps the one JSON line
    cache.push_after()
    if args.json_file:
        write_json_atomic(Path(args.json_file), report.to_json())
    print(json.dumps({k: v for k, v in report.to_json().items() if k != "graphs"}))
    return 1 if report.failed else 0


def _precompile_native(args: argparse.Namespace, recipe: Recipe, cache: Cache) -> int:
    """Compile the plan's graphs with torch.compile and keep PyTorch's compile artifacts as one verified entry
    (pulled first from an s3:// cache, pushed after)."""
    if args.target == "neuron":
        raise UsageError("--target neuron is the Neuron runtime of the XLA path; native compiles with torch.compile")
    backend = backend_for(recipe.runtime)
    plan = make_plan(recipe, backend.name, world=args.nproc_per_node * args.nnodes)
    check_native_precompile(plan, backend)
    cache.pull_paths({native_entry_path(plan, backend.native_device, backend.compiler)})
    report = precompile_native(plan, backend, cache.local)
    log.info(report.table())  # the report for people; stdout keeps the one JSON line
    cache.push_after()
    if args.json_file:
        write_json_atomic(Path(args.json_file), report.to_json())
    print(json.dumps({k: v for k, v in report.to_json().items() if k != "graphs"}))
    return 0


def _precompile_lightning(args: argparse.Namespace) -> int:
    given = [flag for flag, on in (("RECIPE", args.recipe), ("--set", args.overrides), ("--backend", args.backend),
             ("--nproc-per-node", args.nproc_per_node > 1), ("--nnodes", args.nnodes > 1)) if on]  # fmt: skip
    if given:
        raise UsageError(f"precompile --lightning takes the script's own arguments, not {', '.join(given)}")
    target = args.target if args.target != "auto" else ("neuron" if neuron_runtime_present() else "none")
    if target == "neuron" and not neuron_runtime_present():
        raise UsageError("--target neuron needs the Neuron runtime (libneuronxla, installed with torch-neuronx)")
    if importlib.util.find_spec("lightning") is None:
        raise UsageError('precompile --lightning needs the lightning package: pip install "neurontrain[lightning]"')
    os.environ.setdefault("NEURON_PARALLEL_COMPILE_MAX_RETRIES", str(args.retries))
    command = [sys.executable, "-m", "neurontrain.lightning.precompile", args.lightning]
    for flag, value in (("--cache", args.cache), ("--local", args.local), ("--workers", args.workers),
                        ("--json", args.json_file)):  # fmt: skip
        command += [flag, str(value)] if value is not None else []
    command += ["--through-runtime"] if target == "neuron" else []
    # a process of its own: torch-xla's graph dump is set before anything runs, the user's script is isolated
    return subprocess.run(command).returncode
