"""`neurontrain` command line: one entry point, one-line errors, exit codes 0/1/2/3."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Sequence

from neurontrain.errors import NeurontrainError, UsageError


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

    env = sub.add_parser("env", help="print the backend, devices and package versions")
    env.add_argument("--backend", default="auto", choices=["auto", "neuron", "xla-cpu", "xla-cuda", "eager"])
    env.add_argument("--json", action="store_true", help="JSON output")
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    from neurontrain.recipe import load_recipe

    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f"runtime.backend={args.backend}")
    recipe = load_recipe(args.recipe, overrides)
    output_dir = Path(args.output_dir or Path("runs") / recipe.name)
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output-dir {output_dir} exists and is not a directory")

    from neurontrain.backend import resolve_backend_name, select_backend
    from neurontrain.loop.planning import make_plan

    if args.dry_run:
        plan = make_plan(recipe, resolve_backend_name(recipe.runtime.backend))
        print(json.dumps(plan.describe(), indent=2))
        return 0
    backend = select_backend(recipe.runtime.backend, recipe.runtime.compiler_flags)
    plan = make_plan(recipe, backend.name)
    described = plan.describe()
    print(f"neurontrain: {recipe.name} on {backend.name}: {recipe.train.max_steps} steps, buckets "
          f"{described['buckets']['used']} ({plan.bucket_mode}), {len(described['expected_graphs'])} planned graphs, "
          f"output {output_dir}", file=sys.stderr)
    from neurontrain.loop.trainer import Trainer

    summary = Trainer(plan, backend, output_dir).run()
    keys = ("backend", "steps", "first_loss", "final_loss", "compilations", "distinct_graphs",
            "unexpected_graphs", "tokens_per_second", "padding_fraction", "wall_seconds")
    print(json.dumps({k: summary.get(k) for k in keys}))
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    from neurontrain.backend import package_versions, select_backend

    backend = select_backend(args.backend)
    info = {**backend.describe(), "python": sys.version.split()[0], "packages": package_versions(),
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
        handler = {"run": _cmd_run, "env": _cmd_env}[args.command]
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
