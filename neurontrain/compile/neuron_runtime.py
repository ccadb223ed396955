"""Driving the Neuron runtime's compile cache: tell it where the cache is, let it extract the modules of
traced graphs (NEURON_EXTRACT_GRAPHS_ONLY) and observe which module directories it wrote, and let its own
parallel compile phase compile them. The runtime names every module itself; the toolkit only records names.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from neurontrain.backends import neuron_runtime_present
from neurontrain.compile.runtime_cache import (
    EXTRACT_ENV,
    CacheLocation,
    expected_flags_hash,
    platform_target,
    runtime_cache_location,
    runtime_compiler_flags,
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


PRODUCT_NAME = Path("/sys/devices/virtual/dmi/id/product_name")


def host_product_name() -> str | None:
    try:
        return PRODUCT_NAME.read_text().strip()
    except OSError:
        return None


def compiler_version_dir() -> str | None:
    """`neuronxcc-<version>`, the directory the runtime files this compiler's modules under (from
    `neuronx-cc --version`); None without a compiler on PATH."""
    try:
        out = subprocess.run(["neuronx-cc", "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = out.split("version", 1)[1].split() if "version" in out else []
    return f"neuronxcc-{words[0]}" if words else None


def compiler_view(recipe_flags: list[str]) -> dict:
    """What the runtime will hand neuronx-cc for a training graph here: flags, their expected hash, the target
    and who decided it, the compiler's version directory."""
    target = platform_target(os.environ, host_product_name())
    flags = runtime_compiler_flags(os.environ, recipe_flags, target)
    if os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip():
        decided = "NEURON_PLATFORM_TARGET_OVERRIDE"
    else:
        decided = "the host's instance type" if target else "the runtime (not a Trainium host by its product name)"
    return {
        "target": target,
        "target_decided_by": decided,
        "compiler_flags": flags,
        "compiler_flags_hash": expected_flags_hash(flags) if target else None,
        "compiler_version_dir": compiler_version_dir(),
    }
