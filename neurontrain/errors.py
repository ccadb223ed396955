"""Errors that the CLI turns into one readable line and an exit code."""


class NeurontrainError(Exception):
    """A runtime failure the user should read as one line (exit 1)."""

    exit_code = 1


class UsageError(NeurontrainError):
    """Bad input: recipe, flags, paths or data (exit 2)."""

    exit_code = 2


class HealthCheckFailed(NeurontrainError):
    """A device or collective check failed (exit 3)."""

    exit_code = 3


class RecompilationError(NeurontrainError):
    """The recompilation guard found a graph the plan did not expect (exit 1)."""

    exit_code = 1
