"""`neurontrain` command line: one entry point, one-line errors, exit codes 0/1/2/3.

COMMANDS is the verb registry: verb -> (module, one-line help). The top-level parser lists every verb from it
and imports only the chosen verb's module, so that `neurontrain --help`, `neurontrain submit ...` and usage
errors of the light verbs never load torch. Each module in `neurontrain/commands/` defines

    add_arguments(parser: argparse.ArgumentParser) -> None   # the verb's flags (and its own sub-verbs)
    run(args: argparse.Namespace) -> int                     # the exit code; errors raise NeurontrainError

A new verb is one such module and one line here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType

from neurontrain.backends.hosts import skip_torch_xla_imports
from neurontrain.errors import NeurontrainError, UsageError, first_line, raised_in

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("neurontrain.commands.run", "train a recipe"),
    "precompile": ("neurontrain.commands.precompile", "discover a recipe's graphs and compile them ahead of time"),
    "cache": ("neurontrain.commands.cache", "inspect and move the compile cache (local directory or s3://)"),
    "checkpoint": (
        "neurontrain.commands.checkpoint",
        "inspect, migrate and verify checkpoints between GPU and Trainium layouts",
    ),
    "health": ("neurontrain.commands.health", "device and collective checks across workers; exit 3 on failure"),
    "submit": ("neurontrain.commands.submit", "submit a recipe to SLURM or SageMaker"),
    "env": ("neurontrain.commands.env", "print the backend, devices and package versions"),
    "report": ("neurontrain.commands.report", "one HTML page with plots of one or more runs"),
    "compare": ("neurontrain.commands.compare", "compare two runs' losses and metric with a tolerance; exit 1 beyond"),
    "doctor": (
        "neurontrain.commands.doctor",
        "check every Neuron contract the toolkit relies on, on this host; exit 3 when one fails",
    ),
}


# verbs that never use an XLA device: transformers and accelerate are told not to import torch_xla (their
# USE_TORCH_XLA flag), which they otherwise do as soon as a model config is read (about 2 s of start-up)
HOST_ONLY_VERBS = {"checkpoint", "report", "compare"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints the whole usage otherwise)
        raise UsageError(f"{self.prog}: {message}")


def _chosen_verb(argv: Sequence[str]) -> str | None:
    """The verb on the command line: its first word that is not an option (the top level has only -h)."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, ModuleType | None]:
    """The top-level parser listing every verb, with the flags of the verb chosen in `argv` (and its module)."""
    parser = _Parser(prog="neurontrain", description="Train on AWS Trainium through torch-xla.")
    verbs = parser.add_subparsers(dest="command", parser_class=_Parser)
    chosen = _chosen_verb(argv)
    module = None
    for verb, (module_path, help_text) in COMMANDS.items():
        verb_parser = verbs.add_parser(verb, help=help_text)
        if verb == chosen:
            if verb in HOST_ONLY_VERBS:
                skip_torch_xla_imports()
            module = importlib.import_module(module_path)
            module.add_arguments(verb_parser)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser, module = build_parser(argv)
        args = parser.parse_args(argv)
        if module is None:
            parser.print_help()
            return 2
        return module.run(args)
    except NeurontrainError as exc:
        print(f"neurontrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("neurontrain: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a runtime failure: one line, the traceback only on request
        if os.environ.get("NEURONTRAIN_DEBUG"):
            traceback.print_exc()
        where = raised_in(exc)
        hint = (
            f"{where}; set NEURONTRAIN_DEBUG=1 for the traceback"
            if where
            else "set NEURONTRAIN_DEBUG=1 for the traceback"
        )
        print(f"neurontrain: error: {type(exc).__name__}: {first_line(exc)} ({hint})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
