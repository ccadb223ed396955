"""Facts derived from the installed transformers and torch, kept on disk so a later process reads them instead of
importing a modeling module to derive them again (about 1.3 s of CPU each: transformers' modeling code imports
torch._dynamo).

A fact is a pure function of its material (a config, a model type, a key list) and of the versions of transformers
and torch, so it is stored under a digest of exactly those: another release of either is another key. The
directory: $NEURONTRAIN_FACT_CACHE, else $XDG_CACHE_HOME/neurontrain/facts (~/.cache/...). A file that cannot be
read is derived again and one that cannot be written is skipped: the cache never holds the only copy of anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

FORMAT = 1


def fact_directory() -> Path:
    explicit = os.environ.get("NEURONTRAIN_FACT_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "neurontrain" / "facts"


def fact_key(kind: str, material: Any) -> str:
    versions = {name: metadata.version(name) for name in ("transformers", "torch")}
    text = json.dumps({"format": FORMAT, "kind": kind, "versions": versions, "material": material}, sort_keys=True)
    return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def read_fact(kind: str, material: Any) -> Any | None:
    """The stored value, or None when there is none or it cannot be read."""
    try:
        return json.loads((fact_directory() / f"{fact_key(kind, material)}.json").read_text())["value"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_fact(kind: str, material: Any, value: Any) -> None:
    """Store atomically (a concurrent reader sees the old file or the new one); a failure is ignored."""
    directory = fact_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as fh:
            json.dump({"kind": kind, "value": value}, fh)
        os.replace(fh.name, directory / f"{fact_key(kind, material)}.json")
    except OSError:
        return
