"""`neurontrain` command line: one entry point, one-line errors, exit codes 0/1/2/3."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Sequence

from neurontrain.errors import NeurontrainError, UsageError
from neurontrain.launch.run import add_launch_arguments, cmd_run
from neurontrain.launch.submit import add_submit_parser, cmd_submit


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints the whole usage otherwise)
        raise UsageError(f"{self.prog}: {message}")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="neurontrain", description="Train on AWS Trainium through torch-xla.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    run = sub.add_parser("run", help="train a recipe")
    run.add_argument("recipe", help="YAML recipe")
    run.add_argument("--output-dir", "-o", help="where metrics, summary, checkpoints and the model go "
                                                 "(default runs/<recipe name>)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a recipe value, e.g. --set train.max_steps=20 (repeatable)")
    run.add_argument("--backend", choices=["auto", "neuron", "xla-cpu", "xla-cuda", "eager"],
                     help="override runtime.backend; eager = plain PyTorch (the GPU-style reference)")
    run.add_argument("--dry-run", action="store_true", help="validate and print the plan; do not train")
    run.add_argument("--no-preflight", action="store_true", help="skip the health check before training")
    add_launch_arguments(run)

    pre = sub.add_parser("precompile", help="discover a recipe's graphs and compile them ahead of time")
    pre.add_argument("recipe", help="YAML recipe")
    pre.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    pre.add_argument("--backend", choices=["auto", "neuron", "xla-cpu", "xla-cuda"])
    pre.add_argument("--workers", type=int, help="parallel compiler processes (default: from cores and host RAM)")
    pre.add_argument("--cache", help="local cache directory or s3://bucket/prefix (default: runtime.compile_cache)")
    pre.add_argument("--local", help="local directory that mirrors an s3:// cache (default: $NEURONTRAIN_CACHE_DIR "
                                     "or compile_cache)")
    pre.add_argument("--target", choices=["auto", "neuron", "none"], default="auto",
                     help="neuron: the Neuron runtime extracts and compiles every graph into its cache (default "
                          "where the runtime is installed); none: record the graphs only")
    pre.add_argument("--retries", type=int, default=2,
                     help="retries of a failed compile by the runtime (NEURON_PARALLEL_COMPILE_MAX_RETRIES)")
    pre.add_argument("--json", dest="json_file", help="also write the report as JSON to this file")
    pre.add_argument("--nproc-per-node", type=int, default=1, help="plan for this many workers per node")
    pre.add_argument("--nnodes", type=int, default=1, help="plan for this many nodes")

    cache = sub.add_parser("cache", help="inspect and move the compile cache (local directory or s3://)")
    csub = cache.add_subparsers(dest="cache_command", parser_class=_Parser)

    def cache_cmd(name: str, help_text: str, recipe: bool = False) -> argparse.ArgumentParser:
        c = csub.add_parser(name, help=help_text)
        if recipe:
            c.add_argument("recipe", help="YAML recipe")
            c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
            c.add_argument("--backend", choices=["auto", "neuron", "xla-cpu", "xla-cuda"])
        c.add_argument("--cache", help="local directory or s3://bucket/prefix (default: compile_cache)")
        c.add_argument("--local", help="local cache directory mirrored from an s3:// cache (default: compile_cache)")
        c.add_argument("--workers", type=int, default=8, help="objects transferred at a time")
        c.add_argument("--json", action="store_true", help="JSON output")
        return c

    cache_cmd("status", "which of a recipe's graphs are in the cache", recipe=True)
    cache_cmd("ls", "list cache entries")
    cache_cmd("push", "publish local entries missing from an s3:// cache")
    cache_cmd("pull", "fetch entries missing locally from an s3:// cache, verified")
    cache_cmd("verify", "check every entry's files against their SHA-256")
    cache_cmd("prune", "remove entries older than a duration").add_argument(
        "--older-than", required=True, help="e.g. 30d, 12h, 45m")
    cache_cmd("import", "copy the compiled modules of an existing Neuron runtime cache into the local cache"
              ).add_argument("source", help="a runtime cache: local directory or s3://bucket/prefix holding "
                                            "neuronxcc-*/MODULE_*/")

    ckpt = sub.add_parser("checkpoint", help="migrate and verify checkpoints between GPU and Trainium layouts")
    ksub = ckpt.add_subparsers(dest="checkpoint_command", parser_class=_Parser)
    mig = ksub.add_parser("migrate", help="convert SRC to DST (HF/torch/FSDP/DCP <-> NxD per-rank shards)")
    mig.add_argument("src")
    mig.add_argument("dst")
    mig.add_argument("--to", required=True, choices=["neuron", "gpu"])
    mig.add_argument("--tp", type=int, help="tensor-parallel degree (neuron side)")
    mig.add_argument("--pp", type=int, help="pipeline-parallel degree (neuron side)")
    mig.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="cast floating-point tensors")
    mig.add_argument("--fuse-qkv", action="store_true", help="fuse q/k/v into one qkv_proj.weight_qkv per rank")
    mig.add_argument("--with-optimizer", action="store_true", help="also migrate AdamW moments")
    mig.add_argument("--config", help="Hugging Face config (directory or config.json) when SRC has none")
    mig.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    mig.add_argument("--max-shard-size", type=int, default=2048, help="MiB per safetensors file (--to gpu)")
    mig.add_argument("--pad-vocab-to-multiple-of", type=int, metavar="N", help="--to neuron: zero-pad the vocabulary "
                     "to a multiple of N and of --tp (without it: padded to a multiple of --tp only when needed)")
    ver = ksub.add_parser("verify", help="compare two checkpoints tensor by tensor (any formats)")
    ver.add_argument("a")
    ver.add_argument("b")
    ver.add_argument("--atol", type=float, default=0.0, help="tolerated max abs difference (default: bit-identical)")
    ver.add_argument("--logits", metavar="RECIPE_OR_CONFIG", help="also compare model outputs on a sample input")
    ver.add_argument("--config", help="Hugging Face config for sources without one")
    ver.add_argument("--json", action="store_true")

    health = sub.add_parser("health", help="device and collective checks across workers; exit 3 on failure")
    health.add_argument("--nproc-per-node", type=int, default=2)
    health.add_argument("--nnodes", type=int, default=1)
    health.add_argument("--node-rank", type=int, default=0)
    health.add_argument("--master-addr", default="127.0.0.1")
    health.add_argument("--master-port", type=int)
    health.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole check (default 60)")
    health.add_argument("--sizes", default="1K,64K,1M", help="collective sizes in bytes (K/M suffixes)")
    health.add_argument("--iters", type=int, default=10)
    health.add_argument("--min-busbw", type=float, help="fail when the largest size's busbw (GB/s) is below this")
    health.add_argument("--expect-devices", type=int, help="devices each worker must see")
    health.add_argument("--backend", default="auto", choices=["auto", "neuron", "xla-cpu", "xla-cuda", "eager"])
    health.add_argument("--json", dest="json_file", help="write every figure to this file")
    health.add_argument("--work-dir", help="where workers write their progress (default: a temporary directory)")
    health.add_argument("--hosts", help="every node's address, node 0 first (HOST0,HOST1,...): with --nnodes > 1 on "
                                        "Neuron hosts, node 0 runs nccom-test across them (MPI mode); without it, "
                                        "inside a Slurm allocation, Slurm mode")

    add_submit_parser(sub)

    env = sub.add_parser("env", help="print the backend, devices and package versions")
    env.add_argument("--backend", default="auto", choices=["auto", "neuron", "xla-cpu", "xla-cuda", "eager"])
    env.add_argument("--json", action="store_true", help="JSON output")
    return parser


def _cmd_precompile(args: argparse.Namespace) -> int:
    from neurontrain.backend import backend_for, neuron_runtime_present
    from neurontrain.compile.cache import resolve_cache
    from neurontrain.compile.discover import run_plan_id
    from neurontrain.compile.neuron_runtime import attach_runtime, check_precompile_location, describe_location, say
    from neurontrain.compile.precompile import precompile
    from neurontrain.loop.planning import make_plan
    from neurontrain.recipe import load_recipe

    if args.workers is not None and args.workers < 1:
        raise UsageError("--workers must be at least 1")
    if args.retries < 0:
        raise UsageError("--retries must be 0 or more")
    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise UsageError("--nproc-per-node and --nnodes must be at least 1")
    overrides = list(args.overrides) + ([f"runtime.backend={args.backend}"] if args.backend else [])
    recipe = load_recipe(args.recipe, overrides)
    cache = resolve_cache(args.cache or recipe.runtime.compile_cache, args.local)
    backend = backend_for(recipe.runtime)
    target = args.target if args.target != "auto" else ("neuron" if neuron_runtime_present() else "none")
    if target == "neuron" and not neuron_runtime_present():
        raise UsageError("--target neuron needs the Neuron runtime (libneuronxla, installed with torch-neuronx)")
    location = attach_runtime(cache, recipe.runtime) if target == "neuron" else None
    check_precompile_location(location)
    if location is not None:
        os.environ.setdefault("NEURON_PARALLEL_COMPILE_MAX_RETRIES", str(args.retries))
        say(f"Neuron runtime cache: {describe_location(location)}")
    plan = make_plan(recipe, backend.name, world=args.nproc_per_node * args.nnodes)
    if plan.world > 1 and not plan.host_reduce:
        raise UsageError(f"{backend.name} reduces gradients inside the step graph: its data-parallel graphs hold a "
                         f"collective over {plan.world} workers, which one process cannot trace (not built yet). "
                         "Extract them with the runtime instead: neuron_parallel_compile neurontrain run RECIPE "
                         f"--nproc-per-node N --set train.max_steps=K (run keeps nothing under extraction)")
    cache.pull_before(recipe.name, run_plan_id(plan, backend.name))
    report = precompile(plan, backend, cache.local, through_runtime=target == "neuron", workers=args.workers)
    print(report.table(), file=sys.stderr)
    cache.push_after()
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(report.to_json(), indent=2))
    print(json.dumps({k: v for k, v in report.to_json().items() if k != "graphs"}))
    return 1 if report.failed else 0


def _cmd_cache(args: argparse.Namespace) -> int:
    from neurontrain.compile import cache as cachecmd

    if args.cache_command is None:
        raise UsageError("cache needs a command: status, ls, push, pull, verify, prune, import")
    if args.workers < 1:
        raise UsageError("--workers must be at least 1")
    cache = cachecmd.resolve_cache(args.cache, args.local, args.workers)
    if args.cache_command == "import":
        from neurontrain.compile.importer import import_runtime_cache

        report = import_runtime_cache(args.source, cache.local)
        for problem in report["refused"]:
            print(f"neurontrain: refused {problem['module']}: {problem['problem']}", file=sys.stderr)
        print(json.dumps(report))
        return 0
    if args.cache_command in ("push", "pull") and cache.remote is None:
        raise UsageError(f"cache {args.cache_command} needs --cache s3://bucket/prefix")
    if args.cache_command == "status":
        from neurontrain.backend import resolve_backend_name
        from neurontrain.recipe import load_recipe

        overrides = list(args.overrides) + ([f"runtime.backend={args.backend}"] if args.backend else [])
        recipe = load_recipe(args.recipe, overrides)
        if args.cache is None and args.local is None:
            cache = cachecmd.resolve_cache(recipe.runtime.compile_cache, None, args.workers)
        if args.local is None:
            from neurontrain.compile.neuron_runtime import attach_runtime

            attach_runtime(cache, recipe.runtime)
        result = cachecmd.cache_status(recipe, cache, resolve_backend_name(recipe.runtime.backend))
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"{result['recipe']} plan {result['plan_id']} ({result['backend']}): {result.get('note', '')}")
            for g in result["graphs"]:
                modules = "; ".join(f"{m.split('/')[-1]} ({','.join(w) or 'missing'})" for m, w in g["modules"].items())
                print(f"  {' '.join(map(str, g['key'])):<18} {g['graph_id'][:16]:<16}  hlo: {','.join(g['hlo']) or '-'}"
                      f"  compiled modules: {modules or '-'}")
        return 0
    if args.cache_command == "ls":
        rows = cachecmd.list_entries(cache)
        print(json.dumps(rows, indent=2) if args.json else "\n".join(
            " ".join(str(v) for v in row.values()) for row in rows))
        return 0
    if args.cache_command in ("push", "pull"):
        report = cache.remote.push(cache.local) if args.cache_command == "push" else cache.remote.pull(cache.local)
        print(json.dumps(report.to_json()))
        for problem in report.refused:
            print(f"neurontrain: refused {problem['entry']}/{problem['file']}: {problem['problem']}", file=sys.stderr)
        return 1 if report.refused else 0
    if args.cache_command == "verify":
        problems = cachecmd.verify(cache)
        for p in problems:
            print(f"neurontrain: bad {p['entry']}/{p['file']}"
                  + (f" ({p['object']})" if p.get("object") else "") + f": {p['problem']}", file=sys.stderr)
        print(json.dumps({"problems": len(problems), "details": problems}))
        return 1 if problems else 0
    from neurontrain.compile.store import parse_duration

    seconds = parse_duration(args.older_than)
    result = cache.remote.prune(seconds, time.time()) if cache.remote is not None else \
        cachecmd.prune_local(cache.local, args.older_than)
    print(json.dumps(result))
    return 0


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    if args.checkpoint_command is None:
        raise UsageError("checkpoint needs a command: migrate, verify")
    if args.checkpoint_command == "migrate":
        from neurontrain.checkpoint.migrate import MigrateOptions, migrate

        for flag in ("tp", "pp"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise UsageError(f"--{flag} must be at least 1")
        if args.max_shard_size < 1:
            raise UsageError("--max-shard-size must be at least 1 (MiB)")
        opts = MigrateOptions(args.to, args.tp, args.pp, args.dtype, args.fuse_qkv, args.with_optimizer,
                              args.overwrite, Path(args.config) if args.config else None, args.max_shard_size << 20,
                              args.pad_vocab_to_multiple_of)
        print(json.dumps(migrate(Path(args.src), Path(args.dst), opts)))
        return 0
    from neurontrain.checkpoint.migrate import open_checkpoint
    from neurontrain.checkpoint.verify import compare, config_for_logits, logits_diff

    config = Path(args.config) if args.config else None
    a, b = open_checkpoint(Path(args.a), config), open_checkpoint(Path(args.b), config)
    result = compare(a, b, args.atol)
    if args.logits:
        result["logits_max_abs_diff"] = logits_diff(a, b, config_for_logits(Path(args.logits), a, b))
        result["equal"] = result["equal"] and result["logits_max_abs_diff"] <= max(args.atol, 1e-5)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['tensors']} tensors compared, max abs diff {result['max_abs_diff']:.3g}, "
              f"missing in B {len(result['missing_in_b'])}, extra in B {len(result['extra_in_b'])}, "
              f"differing {len(result['differing'])}"
              + (f", logits max abs diff {result['logits_max_abs_diff']:.3g}" if args.logits else "")
              + (": EQUAL" if result["equal"] else ": DIFFERENT"))
        for row in result["differing"][:20]:
            print(f"  {row['name']}: {row['status']} {row['shape_a']}/{row['shape_b']} "
                  f"{row['dtype_a']}/{row['dtype_b']} {row.get('max_abs_diff', '')}")
        for name in result["missing_in_b"][:20]:
            print(f"  {name}: missing in B")
        for name in result["extra_in_b"][:20]:
            print(f"  {name}: extra in B")
    return 0 if result["equal"] else 1


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    try:
        value = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise UsageError(f"bad size {text!r} in --sizes (use e.g. 1K,64K,1M)") from None
    if value < 4:
        raise UsageError(f"size {text!r} in --sizes is below 4 bytes")
    return value


def _cmd_health(args: argparse.Namespace) -> int:
    from neurontrain.errors import HealthCheckFailed
    from neurontrain.health.runner import HealthOptions, format_table, run_health

    for flag in ("nproc_per_node", "nnodes", "iters"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError("--node-rank must be between 0 and --nnodes - 1")
    opts = HealthOptions(args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr, args.master_port,
                         args.timeout, [_parse_size(x) for x in args.sizes.split(",")], args.iters, args.backend,
                         args.expect_devices, args.min_busbw, Path(args.work_dir) if args.work_dir else None,
                         hosts=[h.strip() for h in args.hosts.split(",") if h.strip()] if args.hosts else None)
    result = run_health(opts)
    print(format_table(result), file=sys.stderr)
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result, indent=2))
    if not result["ok"]:
        first = result["bad_ranks"][0] if result["bad_ranks"] else {"rank": "?", "host": "?", "check": "-",
                                                                     "problem": "below the busbw threshold"}
        raise HealthCheckFailed(f"health check failed: rank {first['rank']} on {first['host']}: {first['problem']} "
                                f"({first['check']})")
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    from neurontrain.backend import package_versions, select_backend

    from neurontrain.backend import neuron_runtime_present
    from neurontrain.compile.cache import default_local
    from neurontrain.compile.runtime_cache import runtime_cache_location

    backend = select_backend(args.backend)
    location = runtime_cache_location(os.environ, str(default_local()))
    info = {**backend.describe(), "python": sys.version.split()[0], "packages": package_versions(),
            "neuron_runtime_cache": {"installed": neuron_runtime_present(), "root": location.root,
                                     "decided_by": location.source},
            "environment": {k: v for k, v in os.environ.items()
                            if k.startswith(("NEURON_", "XLA_", "PJRT_")) or k in ("AWS_ENDPOINT_URL",)}}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v if v is not None else '-'}")
        else:
            print(f"{key}: {value}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        handler = {"run": cmd_run, "env": _cmd_env, "precompile": _cmd_precompile,
                   "cache": _cmd_cache, "checkpoint": _cmd_checkpoint, "health": _cmd_health,
                   "submit": cmd_submit}[args.command]
        return handler(args)
    except NeurontrainError as exc:
        print(f"neurontrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("neurontrain: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a runtime failure: one line, the traceback only on request
        if os.environ.get("NEURONTRAIN_DEBUG"):
            traceback.print_exc()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"neurontrain: error: {type(exc).__name__}: {first} (set NEURONTRAIN_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
