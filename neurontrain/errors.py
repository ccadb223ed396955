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


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message (its type name when it has none), at most `limit` chars."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:limit]
