"""`neurontrain run --lightning "SCRIPT [ARGS]"`: a user's Lightning script started as this node's torchrun workers,
with the toolkit's launcher (topology flags, elastic restarts, one-line failures and exit codes). The script's
`Trainer(**neurontrain.lightning.trainer_args(...))` sees torchrun's environment and trains data parallel."""

from __future__ import annotations

import shlex
from pathlib import Path

from neurontrain.errors import UsageError
from neurontrain.launch.elastic import check_master_address, launch
from neurontrain.launch.topology import Topology


def script_argv(command: str) -> list[str]:
    """The script and its arguments from one shell-quoted string; UsageError when the script is not a file."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise UsageError(f"--lightning {command!r}: {exc}") from None
    if not argv:
        raise UsageError('--lightning needs a script: --lightning "train.py --max-steps 100"')
    script = Path(argv[0])
    if script.suffix != ".py" or not script.is_file():
        raise UsageError(f"--lightning: {argv[0]} is not a Python script")
    return argv


def run_lightning(command: str, topology: Topology, recipe_options: list[str]) -> None:
    """Start the script as topology.nproc_per_node workers (restarts as topology.max_restarts says); returns when
    every worker has exited 0."""
    if recipe_options:
        raise UsageError(
            f"--lightning takes the script's own arguments inside its quotes; {', '.join(recipe_options)} "
            "belong to a recipe run"
        )
    argv = script_argv(command)
    check_master_address(topology)
    launch(topology, argv, script=True)
