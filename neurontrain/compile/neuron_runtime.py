"""Driving the Neuron runtime's compile cache: tell it where the cache is, let it extract the modules of
traced graphs (NEURON_EXTRACT_GRAPHS_ONLY) and observe which module directories it wrote, and let its own
parallel compile phase compile them. The runtime names every module itself; the toolkit only records names.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from neurontrain.backends import neuron_runtime_present
from neurontrain.compile.runtime_cache import (
    EXTRACT_ENV,
    CacheLocation,
    runtime_cache_location,
    runtime_environment,
    scan_modules,
    with_cache_dir,
)
from neurontrain.errors import UsageError
from neurontrain.logs import get_logger

log = get_logger(__name__)


def prepare_runtime(
    toolkit_local: Path, compiler_flags: list[str], neuron_target: str = "auto"
) -> CacheLocation | None:
    """Export the cache location and compiler flags to the runtime before the first compile (None when no
    Neuron runtime is installed). The user's NEURON_CC_FLAGS / NEURON_COMPILE_CACHE_URL keep precedence."""
    if not neuron_runtime_present():
        return None
    location = runtime_cache_location(os.environ, str(toolkit_local))
    os.environ.update(runtime_environment(os.environ, location, compiler_flags))
    if neuron_target != "auto":
        if not os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE"):
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = neuron_target
    return location


def attach_runtime(cache, runtime_spec) -> CacheLocation | None:
    """Prepare the runtime for a run or precompile on this node: export its cache location and flags, and
    point the toolkit's local cache at the runtime's root where the user chose one for it (one cache)."""
    location = prepare_runtime(cache.local, list(runtime_spec.compiler_flags), runtime_spec.neuron_target)
    cache.local = toolkit_cache_dir(location, cache.local)
    return location


def toolkit_cache_dir(location: CacheLocation | None, toolkit_local: Path) -> Path:
    """Where manifests and modules live: the runtime's local cache root when the user chose one for it."""
    if location is not None and location.is_local and location.source != "runtime.compile_cache":
        return Path(location.root)
    return toolkit_local


@contextmanager
def _environment(changes: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class Extractor:
    """Runs one graph at a time through the runtime in extraction mode, into a scratch cache of its own (so
    each graph's modules are exactly the directories that appear), then moves new modules into the cache."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.scratch = root / f".extract-{uuid.uuid4().hex[:12]}"

    def extract(self, sync: Callable[[], None]) -> list[str]:
        with self.extracting(uuid.uuid4().hex[:8]) as target:
            sync()
        return self.adopt(target)

    def adopt(self, directory: Path) -> list[str]:
        """Move the modules the runtime wrote under `directory` into the cache; their names."""
        names = sorted(scan_modules(directory))
        for name in names:
            final = self.root / name
            if not final.exists():
                final.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.rename(directory / name, final)
                except OSError:
                    pass  # another process installed the same module meanwhile
            shutil.rmtree(directory / name, ignore_errors=True)
        return names

    @contextmanager
    def extracting(self, name: str = "all") -> Iterator[Path]:
        """Extraction mode for everything run inside, into a scratch directory of its own (adopt it afterwards)."""
        target = self.scratch / name
        target.mkdir(parents=True, exist_ok=True)
        flags = with_cache_dir(os.environ.get("NEURON_CC_FLAGS", ""), str(target))
        with _environment({EXTRACT_ENV: "1", "NEURON_CC_FLAGS": flags}):
            yield target

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def check_precompile_location(location: CacheLocation | None) -> None:
    if location is not None and not location.is_local:
        raise UsageError(
            f"the Neuron runtime's cache is {location.root} ({location.source}): precompile fills a "
            "local runtime cache; unset it and use --cache s3://... (pulled and pushed by the toolkit), "
            "or `neurontrain cache import` to bring an existing one in"
        )


def describe_location(location: CacheLocation | None) -> str:
    if location is None:
        return "no Neuron runtime installed"
    return f"{location.root} (from {location.source})"
