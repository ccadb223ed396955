"""`neurontrain cache status|ls|push|pull|verify|prune|import`: the compile cache, local or s3://."""

from __future__ import annotations

import argparse
import json
import time

from neurontrain.backends import backend_for, resolve_backend_name
from neurontrain.commands.arguments import add_recipe_arguments, recipe_overrides
from neurontrain.compile import cache as compile_cache
from neurontrain.compile.importer import import_runtime_cache
from neurontrain.compile.native_cache import native_status
from neurontrain.compile.neuron_runtime import attach_runtime
from neurontrain.compile.store import parse_duration
from neurontrain.errors import UsageError
from neurontrain.logs import get_logger
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import Recipe, load_recipe

log = get_logger(__name__)

_SUBCOMMANDS = {
    "status": "which of a recipe's graphs are in the cache",
    "ls": "list cache entries",
    "push": "publish local entries missing from an s3:// cache",
    "pull": "fetch entries missing locally from an s3:// cache, verified",
    "verify": "check every entry's files against their SHA-256",
    "prune": "remove entries older than a duration",
    "import": "copy the compiled modules of an existing Neuron runtime cache into the local cache",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cache_command", parser_class=type(parser))
    for name, help_text in _SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        if name == "status":
            add_recipe_arguments(command, eager=False)
            command.add_argument("--nproc-per-node", type=int, default=1, help="the layout's workers per node")
            command.add_argument("--nnodes", type=int, default=1, help="the layout's nodes")
        command.add_argument("--cache", help="local directory or s3://bucket/prefix (default: compile_cache)")
        command.add_argument(
            "--local", help="local cache directory mirrored from an s3:// cache (default: compile_cache)"
        )
        command.add_argument("--workers", type=int, default=8, help="objects transferred at a time")
        command.add_argument("--json", action="store_true", help="JSON output")
        if name == "prune":
            command.add_argument("--older-than", required=True, help="e.g. 30d, 12h, 45m")
        if name == "import":
            command.add_argument(
                "source",
                help="a runtime cache: local directory or s3://bucket/prefix holding neuronxcc-*/MODULE_*/",
            )


def run(args: argparse.Namespace) -> int:
    if args.cache_command is None:
        raise UsageError(f"cache needs a command: {', '.join(_SUBCOMMANDS)}")
    if args.workers < 1:
        raise UsageError("--workers must be at least 1")
    cache = compile_cache.resolve_cache(args.cache, args.local, args.workers)
    if args.cache_command in ("push", "pull") and cache.remote is None:
        raise UsageError(f"cache {args.cache_command} needs --cache s3://bucket/prefix")
    handler = {
        "status": _status,
        "ls": _list,
        "push": _transfer,
        "pull": _transfer,
        "verify": _verify,
        "prune": _prune,
        "import": _import,
    }[args.cache_command]
    return handler(args, cache)


def _status(args: argparse.Namespace, cache: compile_cache.Cache) -> int:
    recipe = load_recipe(args.recipe, recipe_overrides(args))
    if args.cache is None and args.local is None:
        cache = compile_cache.resolve_cache(recipe.runtime.compile_cache, None, args.workers)
    if args.local is None:
        attach_runtime(cache, recipe.runtime)
    if resolve_backend_name(recipe.runtime.backend) == "native":
        return _native_status(args, recipe, cache)
    result = compile_cache.cache_status(recipe, cache, resolve_backend_name(recipe.runtime.backend))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['recipe']} plan {result['plan_id']} ({result['backend']}): {result.get('note', '')}")
    for g in result["graphs"]:
        modules = "; ".join(f"{m.split('/')[-1]} ({','.join(w) or 'missing'})" for m, w in g["modules"].items())
        print(
            f"  {' '.join(map(str, g['key'])):<18} {g['graph_id'][:16]:<16}  hlo: {','.join(g['hlo']) or '-'}"
            f"  compiled modules: {modules or '-'}"
        )
    return 0


def _native_status(args: argparse.Namespace, recipe: Recipe, cache: compile_cache.Cache) -> int:
    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise UsageError("--nproc-per-node and --nnodes must be at least 1")
    backend = backend_for(recipe.runtime)
    plan = make_plan(recipe, backend.name, world=args.nproc_per_node * args.nnodes)
    result = native_status(plan, cache, backend.native_device, backend.compiler)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    problem = result["local_problem"]
    local = "no" if not result["local"] else (f"refused ({problem})" if problem else "yes")
    remote = {None: "-", True: "yes", False: "no"}[result["remote"]]
    print(f"{result['recipe']} plan {result['plan_id']} (native): {result.get('note', '')}")
    print(f"  artifacts {result['entry']}  local: {local}  remote: {remote}")
    print(f"  planned graphs: {', '.join(' '.join(map(str, k)) for k in result['planned_graphs'])}")
    for entry in result["recipe_entries"]:
        where = ", ".join(w for w in ("local", "remote") if entry[w])
        workers = f"{entry['workers']} worker(s)" if entry["workers"] else "workers unknown (not local)"
        print(f"  native entry {entry['entry']}: {workers}, {entry['device']} {where}")
    return 0


def _list(args: argparse.Namespace, cache: compile_cache.Cache) -> int:
    rows = compile_cache.list_entries(cache)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print("\n".join(" ".join(str(v) for v in row.values()) for row in rows))
    return 0


def _transfer(args: argparse.Namespace, cache: compile_cache.Cache) -> int:
    report = cache.remote.push(cache.local) if args.cache_command == "push" else cache.remote.pull(cache.local)
    print(json.dumps(report.to_json()))
    for problem in report.refused:
        log.warning(f"refused {problem['entry']}/{problem['file']}: {problem['problem']}")
    return 1 if report.refused else 0


def _verify(args: argparse.Namespace, cache: compile_cache.Cache) -> int:
    problems = compile_cache.verify(cache)
    for p in problems:
        where = f" ({p['object']})" if p.get("object") else ""
        log.warning(f"bad {p['entry']}/{p['file']}{where}: {p['problem']}")
    print(json.dumps({"problems": len(problems), "details": problems}))
    return 1 if problems else 0


def _prune(args: argparse.Namespace, cache: compile_cache.Cache) -> int:
    seconds = parse_duration(args.older_than)
    if cache.remote is not None:
        result = cache.remote.prune(seconds, time.time())
    else:
        result = compile_cache.prune_local(cache.local, args.older_than)
    print(json.dumps(result))
    return 0


def _import(args: argparse.Namespace, cache: compile_cache.Cache) -> int:
    report = import_runtime_cache(args.source, cache.local)
    for problem in report["refused"]:
        log.warning(f"refused {problem['module']}: {problem['problem']}")
    print(json.dumps(report))
    return 0
