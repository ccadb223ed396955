"""Argument groups the verbs share, and how `run`'s arguments reach the workers.

`run` has two kinds of arguments:

* worker arguments (`add_worker_arguments`): the recipe, --output-dir, --set, --backend, --no-preflight,
  --init-from, --init-from-weights-only. Every launcher passes them on as `worker_argv` renders them from
  these very actions and the parsed namespace: torchrun's workers, the node command of the sbatch script
  `submit slurm` writes, and the SageMaker entry (through a hyperparameter). `submit slurm` and `submit
  sagemaker` accept them too. A flag added there reaches every worker with no other change.
* launcher-only arguments (`add_launcher_arguments`): --dry-run and the torchrun topology, which each launcher
  sets for itself (the sbatch script from Slurm's variables, the SageMaker entry from SM_HOSTS), and --lightning
  (the workers are then the script, with its own arguments).

A test walks every action of the `run` parser and fails on one that is neither.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from neurontrain.backends import BACKENDS

Options = TypeVar("Options")


def backend_choices(eager: bool = True) -> list[str]:
    """--backend's choices: auto and the backends (without eager for the commands that compile graphs ahead of a
    run: eager compiles nothing)."""
    return ["auto", *(name for name in BACKENDS if eager or name != "eager")]


def add_backend_argument(parser: argparse.ArgumentParser, *, default: str | None = None, eager: bool = True) -> None:
    help_text = "override runtime.backend" if default is None else f"backend (default {default})"
    if eager:
        help_text += "; eager = plain PyTorch (the GPU-style reference)"
    parser.add_argument("--backend", default=default, choices=backend_choices(eager), help=help_text)


def add_recipe_arguments(parser: argparse.ArgumentParser, *, eager: bool = True, required: bool = True) -> None:
    """The recipe, its --set overrides and --backend (see `recipe_overrides`)."""
    parser.add_argument("recipe", nargs=None if required else "?", help="YAML recipe")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe value, e.g. --set train.max_steps=20 (repeatable)",
    )
    add_backend_argument(parser, eager=eager)


def recipe_overrides(args: argparse.Namespace) -> list[str]:
    """The --set expressions, then --backend as runtime.backend."""
    return [*args.overrides, *([f"runtime.backend={args.backend}"] if args.backend else [])]


def add_worker_arguments(
    parser: argparse.ArgumentParser, *, output_dir: bool = True, recipe_required: bool = True
) -> None:
    """`run`'s arguments that every worker gets (output_dir=False: where the launcher fixes the directory)."""
    if output_dir:
        parser.add_argument(
            "--output-dir",
            "-o",
            help="where metrics, summary, checkpoints and the model go (default runs/<recipe name>)",
        )
    add_recipe_arguments(parser, required=recipe_required)
    parser.add_argument("--no-preflight", action="store_true", help="skip the health check before training")
    parser.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from these weights: NxD shards (`checkpoint migrate --to neuron`) or any checkpoint migrate "
        "reads, and from its AdamW moments when it holds them (learning rate and schedule stay the recipe's); "
        "a run that resumes from its own checkpoint ignores it",
    )
    parser.add_argument(
        "--init-from-weights-only",
        action="store_true",
        help="with --init-from: take the weights only; AdamW starts fresh even when the checkpoint has its state",
    )


def recipe_options_given(args: argparse.Namespace, *, output_dir: bool = True) -> list[str]:
    """The recipe-only options given (a Lightning script takes its own arguments instead). output_dir: whether
    --output-dir counts as one (`submit slurm` keeps it: the job's script and logs go there)."""
    given = {
        "RECIPE": args.recipe is not None,
        "--set": bool(args.overrides),
        "--backend": args.backend is not None,
        "--output-dir": output_dir and args.output_dir is not None,
        "--init-from": args.init_from is not None,
        "--dry-run": getattr(args, "dry_run", False),
        "--no-preflight": args.no_preflight,
    }
    return [name for name, present in given.items() if present]


def add_lightning_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lightning",
        metavar='"SCRIPT [ARGS]"',
        help="instead of a recipe: start a Lightning script (and its arguments, one quoted string) as the "
        "workers, through torchrun; the script's Trainer takes neurontrain.lightning.trainer_args()",
    )


def add_topology_arguments(
    parser: argparse.ArgumentParser,
    *,
    nproc_per_node: int | None = None,
    master_port: int | None = 29500,
    elastic: bool = True,
) -> None:
    """Where the workers run and meet (torchrun's flags); elastic adds c10d rendezvous and restarts."""
    g = parser.add_argument_group("data-parallel workers (torchrun)")
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=nproc_per_node,
        help="workers on this node (launches through torchrun)"
        if nproc_per_node is None
        else f"workers on this node (default {nproc_per_node})",
    )
    g.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    g.add_argument("--node-rank", type=int, default=0, help="this node's rank (static rendezvous)")
    g.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (static rendezvous)")
    g.add_argument(
        "--master-port",
        type=int,
        default=master_port,
        help=f"node 0's port (default {master_port})" if master_port else "node 0's port (default: a free one)",
    )
    if not elastic:
        return
    g.add_argument("--rdzv-endpoint", help="HOST:PORT of a c10d rendezvous instead of the static one")
    g.add_argument("--rdzv-id", help="job id shared by all nodes of a c10d rendezvous")
    g.add_argument("--rdzv-timeout", type=int, default=900, help="seconds to wait for all nodes (default 900)")
    g.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the workers this often after a failure; they resume from the latest checkpoint",
    )


def add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """`run`'s arguments that only the launching process reads."""
    parser.add_argument("--dry-run", action="store_true", help="validate and print the plan; do not train")
    add_topology_arguments(parser)
    add_lightning_argument(parser)  # the workers are the script itself
    g = parser.add_argument_group("Ray (heterogeneous clusters)")
    g.add_argument(
        "--launcher",
        choices=("torchrun", "ray"),
        default="torchrun",
        help="start the workers through torchrun (default) or as a Ray Train worker group on trainium-labelled "
        "Ray nodes (needed by data.service.kind ray)",
    )
    g.add_argument(
        "--local-cluster",
        metavar="data=N,trainium=M",
        help="with --launcher ray: start a loopback Ray cluster of N data and M trainium nodes on this machine",
    )


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser, recipe_required=False)
    add_launcher_arguments(parser)


def _dests(add: Callable[[argparse.ArgumentParser], None]) -> frozenset[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add(parser)
    return frozenset(action.dest for action in parser._actions)


def worker_dests() -> frozenset[str]:
    """The namespace names of `run`'s worker arguments."""
    return _dests(add_worker_arguments)


def launcher_only_dests() -> frozenset[str]:
    return _dests(add_launcher_arguments)


def _render(action: argparse.Action, value: object) -> list[str]:
    """One argument's value as command-line words that parse back to it (none for the default)."""
    if not action.option_strings:
        return [str(value)]
    flag = max(action.option_strings, key=len)
    if isinstance(action, argparse._StoreTrueAction):
        return [flag] if value else []
    if isinstance(action, argparse._AppendAction) and action.nargs is None:
        return [word for item in value or () for word in (flag, str(item))]
    if isinstance(action, argparse._StoreAction) and action.nargs is None:
        return [] if value is None or value == action.default else [flag, str(value)]
    raise TypeError(f"{flag}: a {type(action).__name__} cannot be passed on to the workers yet (see _render)")


def worker_argv(args: argparse.Namespace, *, carried: Collection[str] = ()) -> list[str]:
    """`run`'s worker arguments in `args` as a command line (positionals first) that parses back to the same
    values. carried: names the launcher passes another way (SageMaker: the recipe travels as hyperparameters)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_worker_arguments(parser)
    positionals: list[str] = []
    options: list[str] = []
    for action in parser._actions:
        if action.dest not in carried:
            words = _render(action, getattr(args, action.dest))
            (options if action.option_strings else positionals).extend(words)
    return positionals + options


def options_from(cls: type[Options], args: argparse.Namespace, **values: Any) -> Options:
    """An option object (a keyword-only dataclass) from the parsed arguments of the same names; `values` for
    the fields whose flag has another name or needs converting. The object checks its own bounds."""
    names = {f.name for f in dataclasses.fields(cls) if f.init and f.name not in values}
    return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)}, **values)
