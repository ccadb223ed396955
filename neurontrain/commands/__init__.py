"""The `neurontrain` verbs, one module each (`add_arguments(parser)`, `run(args) -> int`); the registry that
maps a verb to its module is `neurontrain.cli.COMMANDS`."""
