"""`neurontrain cache import SRC`: bring the compiled modules of an existing Neuron runtime cache (a local
directory, or an s3:// prefix that neuron_parallel_compile or the runtime filled: <prefix>/neuronxcc-*/MODULE_*/)
into the local cache, so a team keeps what it already compiled. Only complete modules (a non-empty NEFF and
the done marker) come in; each is installed with one rename, never over an existing module."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from neurontrain.compile.s3 import S3Store
from neurontrain.errors import UsageError

_MODULE_FILE = re.compile(r"^(?:.*/)?(neuronxcc-[^/]+/MODULE_[^/]+)/([^/]+)$")
REQUIRED = ("model.neff", "model.done")


def _complete(files: dict[str, int]) -> str:
    """'' when a module's files (name -> size) make a compiled module, else why not."""
    missing = [n for n in REQUIRED if n not in files]
    if missing:
        return f"no {', '.join(missing)} (not compiled, failed, or still compiling)"
    if files["model.neff"] == 0:
        return "empty NEFF"
    return ""


def _install(root: Path, module: str, fetch: Callable[[str, Path], None], names: list[str]) -> None:
    final = root / module
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".import-", dir=final.parent))
    try:
        for name in names:
            fetch(name, staging / name)
        staging.rename(final)
    except OSError:
        if not final.exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _modules_local(src: Path) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for d in sorted(src.glob("neuronxcc-*/MODULE_*")):
        if d.is_dir():
            out[f"{d.parent.name}/{d.name}"] = {
                p.name: p.stat().st_size for p in d.iterdir() if p.is_file() and not p.name.endswith(".lock")
            }
    return out


def _modules_s3(client, bucket: str, prefix: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            match = _MODULE_FILE.match(obj["Key"][len(prefix) :])
            if match and not match.group(2).endswith(".lock"):
                out.setdefault(match.group(1), {})[match.group(2)] = obj["Size"]
    return out


def import_runtime_cache(src: str, root: Path) -> dict:
    """Copy every complete module of SRC missing from `root`; report imported / present / refused."""
    if src.startswith("s3://"):
        store = S3Store(src)
        store.check()
        modules = _modules_s3(store.client, store.bucket, store.prefix)

        def fetcher(module: str) -> Callable[[str, Path], None]:
            return lambda name, dest: store.client.download_file(
                store.bucket, f"{store.prefix}{module}/{name}", str(dest)
            )
    else:
        base = Path(src)
        if not base.is_dir():
            raise UsageError(f"cache import: {src} is not a directory or s3://bucket/prefix")
        modules = _modules_local(base)

        def fetcher(module: str) -> Callable[[str, Path], None]:
            return lambda name, dest: shutil.copyfile(base / module / name, dest)

    report: dict = {"source": src, "modules_found": len(modules), "imported": 0, "already_present": 0, "refused": []}
    for module, files in sorted(modules.items()):
        problem = _complete(files)
        if problem:
            report["refused"].append({"module": module, "problem": problem})
        elif (root / module).exists():
            report["already_present"] += 1
        else:
            _install(root, module, fetcher(module), sorted(files))
            report["imported"] += 1
    return report
