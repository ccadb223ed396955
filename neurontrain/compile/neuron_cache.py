"""The Neuron persistent compile cache: names, flag canonicalisation and entry states. Pure logic, no I/O
beyond reading a module directory's listing.

Layout: <root>/neuronxcc-<compiler version>/MODULE_<graph hash>+<flags hash>/ with model.hlo_module.pb,
compile_flags.json, and model.neff + model.done (compiled), or model.log without a NEFF (failed; cached as
failed), or *.lock (a compile in progress, or stale).
"""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path


def canonical_flags(flags: list[str] | str) -> str:
    """One spelling per flag set: `--opt value` becomes `--opt=value`, flags sorted, duplicates dropped.
    The flags hash keys the cache, so `-O1 --model-type transformer` and `--model-type=transformer -O1`
    must land on the same entry."""
    tokens = shlex.split(flags) if isinstance(flags, str) else [t for f in flags for t in shlex.split(f)]
    merged: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("--") and "=" not in token and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
            merged.append(f"{token}={tokens[i + 1]}")
            i += 2
        else:
            merged.append(token)
            i += 1
    return " ".join(sorted(set(merged)))


def flags_hash(canonical: str) -> str:
    """First 8 hex digits of the MD5 of the flag string (d41d8cd9 = no flags)."""
    return hashlib.md5(canonical.encode()).hexdigest()[:8]


def module_dir(root: Path, compiler_version: str, graph_hash: str, canonical: str) -> Path:
    return root / f"neuronxcc-{compiler_version}" / f"MODULE_{graph_hash}+{flags_hash(canonical)}"


def entry_state(directory: Path) -> str:
    """missing | compiled | failed | locked | incomplete."""
    if not directory.is_dir():
        return "missing"
    names = {p.name for p in directory.iterdir()}
    if "model.neff" in names and "model.done" in names:
        return "compiled"
    if any(n.endswith(".lock") for n in names):
        return "locked"
    if "model.log" in names and "model.neff" not in names:
        return "failed"
    return "incomplete"


def parse_compiler_version(output: str) -> str:
    """`neuronx-cc --version` prints e.g. 'NeuronX Compiler version 2.21.18209.0+043b1bf7'."""
    for token in output.replace("\n", " ").split():
        if token[:1].isdigit() and "." in token:
            return token
    raise ValueError(f"no version in {output.strip()[:200]!r}")


def default_workers(cores: int, ram_bytes: int, per_compile_bytes: int = 64 << 30) -> int:
    """As many compiles as both the cores and the host RAM allow (neuronx-cc takes up to ~64 GiB a graph)."""
    return max(1, min(cores, ram_bytes // per_compile_bytes))
