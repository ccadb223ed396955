"""The `neurontrain` verbs: verb -> (module, one-line help).

`neurontrain.cli` lists every verb from this table and imports only the chosen verb's module, so that
`neurontrain --help`, `neurontrain submit ...` and usage errors never load torch. Each module defines

    add_arguments(parser: argparse.ArgumentParser) -> None   # the verb's flags (and its own sub-verbs)
    run(args: argparse.Namespace) -> int                     # the exit code; errors raise NeurontrainError

A new verb is one module with those two functions and one line here.
"""

from __future__ import annotations

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("neurontrain.commands.run", "train a recipe"),
    "precompile": ("neurontrain.commands.precompile", "discover a recipe's graphs and compile them ahead of time"),
    "cache": ("neurontrain.commands.cache", "inspect and move the compile cache (local directory or s3://)"),
    "checkpoint": (
        "neurontrain.commands.checkpoint",
        "migrate and verify checkpoints between GPU and Trainium layouts",
    ),
    "health": ("neurontrain.commands.health", "device and collective checks across workers; exit 3 on failure"),
    "submit": ("neurontrain.commands.submit", "submit a recipe to SLURM or SageMaker"),
    "env": ("neurontrain.commands.env", "print the backend, devices and package versions"),
}
