"""Errors that the CLI turns into one readable line and an exit code."""

from __future__ import annotations

from collections.abc import Mapping


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


def dependency_frames(modules: list[str], installed: Mapping[str, list[str]]) -> tuple[str | None, str | None]:
    """Of the modules of a traceback's frames (outermost first): the installed package neurontrain called into,
    and the innermost installed package, where the exception was raised. `installed` maps top-level module names
    to distributions (importlib.metadata.packages_distributions); neurontrain, the standard library and scripts
    do not count. None where there is none."""
    import sys

    outside = [
        top
        for top in (module.split(".", 1)[0] for module in modules)
        if top in installed and top != "neurontrain" and top not in sys.stdlib_module_names
    ]
    if not outside:
        return None, None
    return outside[0], outside[-1]


def _distribution(top: str, installed: Mapping[str, list[str]]) -> str:
    """`name version` of the installed distribution that provides top-level module `top` (PyYAML for yaml)."""
    from importlib import metadata

    name = installed[top][0]
    try:
        return f"{name} {metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def raised_in(exc: BaseException) -> str | None:
    """Which installed package raised `exc`, with its version, and through which package neurontrain called it
    ("raised in kernels 0.19.1, called through transformers 5.25.0"): a user can then tell a toolkit bug from a
    dependency release that changed. None when it was raised in neurontrain or the standard library."""
    tb = exc.__traceback__
    modules: list[str] = []
    while tb is not None:
        modules.append(str(tb.tb_frame.f_globals.get("__name__", "")))
        tb = tb.tb_next
    from importlib import metadata

    installed = metadata.packages_distributions()
    entry, inner = dependency_frames(modules, installed)
    if entry is None or inner is None:
        return None
    where = f"raised in {_distribution(inner, installed)}"
    return where if entry == inner else f"{where}, called through {_distribution(entry, installed)}"
