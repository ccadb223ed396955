"""Where the Neuron runtime keeps compiled modules, and what it wrote there. Pure logic over environment dicts
and directory listings; the runtime itself (libneuronxla, inside torch-neuronx) names, stores and compiles
the modules: nothing here computes a module key or a flags hash.

The runtime's cache root, by its own precedence: `--cache_dir=` in NEURON_CC_FLAGS, else
NEURON_COMPILE_CACHE_URL, else /var/tmp/neuron-compile-cache. Under it:
`neuronxcc-<compiler version>/MODULE_<key>+<flags hash>/` with `model.hlo_module.pb`, `compile_flags.json`,
`model.neff` + `model.done` once compiled, `model.log` without a NEFF after a failed compile, and a
`*.lock` file while a compile runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

RUNTIME_DEFAULT_CACHE = "/var/tmp/neuron-compile-cache"
EXTRACT_ENV = "NEURON_EXTRACT_GRAPHS_ONLY"
# Consumed by the runtime's compiler wrapper; never part of a neuronx-cc command line.
WRAPPER_ONLY_FLAGS = ("--cache_dir", "--retry_failed_compilation", "--log_level", "--dump_results")


def extraction_mode(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the runtime only extracts graphs (executions return zeros, so nothing computed is real)."""
    return environ.get(EXTRACT_ENV, "").strip().lower() not in ("", "0", "false", "no")


def flag_tokens(flags: str) -> list[str]:
    return shlex.split(flags or "")


def cache_dir_flag(neuron_cc_flags: str) -> str | None:
    """The value of `--cache_dir=X` / `--cache_dir X` in NEURON_CC_FLAGS (the last one wins), if any."""
    tokens, found = flag_tokens(neuron_cc_flags), None
    for i, token in enumerate(tokens):
        if token.startswith("--cache_dir="):
            found = token.split("=", 1)[1]
        elif token == "--cache_dir" and i + 1 < len(tokens):
            found = tokens[i + 1]
    return found


def with_cache_dir(neuron_cc_flags: str, directory: str) -> str:
    """NEURON_CC_FLAGS with every --cache_dir replaced by one pointing at `directory` (other flags kept,
    in their order: the runtime hashes its flags in the order given)."""
    tokens, out, skip = flag_tokens(neuron_cc_flags), [], False
    for i, token in enumerate(tokens):
        if skip:
            skip = False
            continue
        if token.startswith("--cache_dir="):
            continue
        if token == "--cache_dir":
            skip = i + 1 < len(tokens)
            continue
        out.append(token)
    return shlex.join(out + [f"--cache_dir={directory}"])


@dataclass(frozen=True)
class CacheLocation:
    root: str  # a local directory, or s3://bucket/prefix the runtime reads itself
    source: str  # which setting decided it

    @property
    def is_local(self) -> bool:
        return not self.root.startswith("s3://")


def runtime_cache_location(environ: Mapping[str, str], toolkit_local: str) -> CacheLocation:
    """The runtime's precedence, with the toolkit's local cache directory where the user set neither."""
    flag_dir = cache_dir_flag(environ.get("NEURON_CC_FLAGS", ""))
    if flag_dir:
        return CacheLocation(flag_dir, "--cache_dir in NEURON_CC_FLAGS")
    url = environ.get("NEURON_COMPILE_CACHE_URL")
    if url:
        return CacheLocation(url, "NEURON_COMPILE_CACHE_URL")
    return CacheLocation(str(Path(toolkit_local).absolute()), "runtime.compile_cache")


def runtime_environment(environ: Mapping[str, str], location: CacheLocation, recipe_flags: list[str]) -> dict:
    """The variables to export before the first compile: the cache location (only where the user set none)
    and the recipe's compiler flags appended to NEURON_CC_FLAGS (never replacing the user's)."""
    out: dict[str, str] = {}
    current = environ.get("NEURON_CC_FLAGS", "")
    missing = [f for f in recipe_flags if f not in flag_tokens(current)]
    if missing:
        out["NEURON_CC_FLAGS"] = " ".join(x for x in [current.strip(), shlex.join(missing)] if x)
    if location.source == "runtime.compile_cache":
        out["NEURON_COMPILE_CACHE_URL"] = location.root
    return out


def _wrapper_only(token: str) -> bool:
    return any(token == f or token.startswith(f + "=") for f in WRAPPER_ONLY_FLAGS)


def compiler_tokens(neuron_cc_flags: str) -> list[str]:
    """NEURON_CC_FLAGS without the wrapper-only options (and the values of `--cache_dir X` / `--log_level X`):
    what reaches neuronx-cc, in the order given."""
    out, skip = [], False
    for token in flag_tokens(neuron_cc_flags):
        if skip:
            skip = False
        elif _wrapper_only(token):
            skip = "=" not in token and token in ("--cache_dir", "--log_level")
        else:
            out.append(token)
    return out


def runtime_compiler_flags(environ: Mapping[str, str], recipe_flags: list[str], target: str | None) -> list[str]:
    """The flags the runtime gives neuronx-cc for a training graph (and hashes into each module's name):
    `--target=<platform>` first, then the user's NEURON_CC_FLAGS less the wrapper's own options, then the
    recipe's flags that `runtime_environment` appends. Without a known target, the list starts at the user's."""
    user = compiler_tokens(environ.get("NEURON_CC_FLAGS", ""))
    flags = ([f"--target={target}"] if target else []) + user
    return flags + [f for f in recipe_flags if f not in user]


def expected_flags_hash(flags: list[str]) -> str:
    """The `+<hash>` suffix real caches show for a flag list: md5 of its JSON, 8 hex digits (`d41d8cd9` for
    none: the md5 of nothing). A prediction to compare with what the runtime writes (`module_flags_hash`), never
    a module's name."""
    return hashlib.md5(json.dumps(flags).encode() if flags else b"").hexdigest()[:8]


def module_flags_hash(module: str) -> str:
    """The flags hash in a module directory's name (`neuronxcc-<v>/MODULE_<key>+<hash>`)."""
    return module.rsplit("+", 1)[-1] if "+" in module else ""


def platform_target(environ: Mapping[str, str], product_name: str | None) -> str | None:
    """The target the runtime compiles for: NEURON_PLATFORM_TARGET_OVERRIDE, else the host's instance family
    (trn1/trn2/trn3 from its product name), else None (not a Trainium host: the runtime decides)."""
    override = environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip()
    if override:
        return override
    family = (product_name or "").strip().split(".")[0]
    return family if family in ("trn1", "trn2", "trn3", "inf2") else None


def module_state(names: set[str]) -> str:
    """compiled | failed | locked | extracted (HLO only) | empty, from a module directory's file names."""
    if "model.neff" in names and "model.done" in names:
        return "compiled"
    if any(n.endswith(".lock") for n in names):
        return "locked"
    if "model.log" in names and "model.neff" not in names:
        return "failed"
    if "model.hlo_module.pb" in names:
        return "extracted"
    return "empty"


def scan_modules(root: Path) -> dict[str, str]:
    """{"neuronxcc-<v>/MODULE_<key>+<flags>": state} for every module directory under a local runtime cache."""
    out: dict[str, str] = {}
    if not root.is_dir():
        return out
    for version_dir in root.glob("neuronxcc-*"):
        for module in version_dir.glob("MODULE_*"):
            if module.is_dir():
                out[f"{version_dir.name}/{module.name}"] = module_state({p.name for p in module.iterdir()})
    return out


def new_modules(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    return sorted(set(after) - set(before))


def gained_neff(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """Modules compiled between two scans (new, or present before without a NEFF)."""
    return sorted(m for m, s in after.items() if s == "compiled" and before.get(m) != "compiled")
