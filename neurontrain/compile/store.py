"""Cache stores: the local cache directory and s3://bucket/prefix, holding content-addressed entries.

An entry is a directory of files under the cache root (graphs/<id>/, neuronxcc-<v>/MODULE_<h>+<f>/,
native/<recipe>-<key>/, manifests/<name>.json as a one-file entry). Remotely an entry is published as
  <prefix>/entries/<entry path>/ENTRY.json   {"files": {name: {"sha256", "size"}}, ...}
  <prefix>/blobs/<sha256>                    the files' bytes, stored under their SHA-256
Blobs go first, ENTRY.json last with a conditional put (If-None-Match: *), so an entry is visible only
once complete, the first complete publisher wins, and concurrent publishers of the same entry never mix
files. Readers check every blob's size and SHA-256 and refuse an entry that does not match.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from neurontrain.compile.graphs import graph_id
from neurontrain.errors import UsageError

ENTRY_RECORD = ".neurontrain-entry.json"  # kept in pulled entry directories, so a local verify can check them
_MODULE_DIR = re.compile(r"^neuronxcc-[^/]+/MODULE_[^/]+$")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class LocalEntry:
    path: str  # relative to the cache root, '/'-separated
    location: Path  # the directory (or the file, for a one-file entry)
    is_file: bool

    def files(self) -> dict[str, Path]:
        if self.is_file:
            return {self.location.name: self.location}
        return {
            p.name: p
            for p in sorted(self.location.iterdir())
            if p.is_file() and p.name != ENTRY_RECORD and not p.name.endswith(".lock") and not p.name.startswith(".")
        }

    def record(self) -> dict:
        return {
            "path": self.path,
            "is_file": self.is_file,
            "files": {name: {"sha256": sha256_file(p), "size": p.stat().st_size} for name, p in self.files().items()},
        }

    def mtime(self) -> float:
        return self.location.stat().st_mtime


def local_entries(root: Path) -> dict[str, LocalEntry]:
    """Complete entries of a local cache: recorded graphs, manifests, Neuron modules with a NEFF and done marker."""
    out: dict[str, LocalEntry] = {}
    if not root.is_dir():
        return out
    for d in sorted((root / "graphs").glob("*")):
        if (d / "model.hlo_module.pb").is_file():
            out[f"graphs/{d.name}"] = LocalEntry(f"graphs/{d.name}", d, False)
    for f in sorted((root / "manifests").glob("*.json")):
        out[f"manifests/{f.name}"] = LocalEntry(f"manifests/{f.name}", f, True)
    for d in sorted(root.glob("neuronxcc-*/MODULE_*")):
        if d.is_dir() and (d / "model.done").is_file() and (d / "model.neff").is_file():
            rel = f"{d.parent.name}/{d.name}"
            out[rel] = LocalEntry(rel, d, False)
    for d in sorted((root / "native").glob("*")):  # the native backend's artifacts: compile/native_cache.py
        complete = (d / "artifacts.bin").is_file() and (d / "entry.json").is_file()
        if d.is_dir() and not d.name.startswith(".") and complete:
            out[f"native/{d.name}"] = LocalEntry(f"native/{d.name}", d, False)
    for f in sorted((root / "xla").glob("*")):
        if f.is_file() and not f.name.startswith("."):
            out[f"xla/{f.name}"] = LocalEntry(f"xla/{f.name}", f, True)
    return out


def valid_entry_path(path: str) -> bool:
    parts = path.split("/")
    return (
        len(parts) == 2
        and all(p and p not in (".", "..") and not p.startswith(".") for p in parts)
        and parts[0] in ("graphs", "manifests", "xla", "native")
        or bool(_MODULE_DIR.match(path))
    )


def install_entry(root: Path, path: str, is_file: bool, files: dict[str, Path], record: dict) -> bool:
    """Move verified downloaded files into place atomically. False if the entry appeared meanwhile."""
    final = root / path
    if final.exists():
        return False
    final.parent.mkdir(parents=True, exist_ok=True)
    if is_file:
        ((name, src),) = files.items()
        os.replace(src, final)
        return True
    staging = root / f".pull-{uuid.uuid4().hex}"
    staging.mkdir()
    for name, src in files.items():
        os.replace(src, staging / name)
    (staging / ENTRY_RECORD).write_text(json.dumps(record))
    try:
        os.rename(staging, final)  # atomic; fails if another process installed it first
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        return False
    return True


def remove_entry(entry: LocalEntry, root: Path) -> None:
    trash = root / f".trash-{uuid.uuid4().hex}"
    os.rename(entry.location, trash)  # gone from readers' view at once
    if trash.is_dir():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        trash.unlink(missing_ok=True)


def verify_local(root: Path) -> list[dict]:
    """Problems of a local cache: pulled entries whose files differ from their record, recorded graphs whose
    HLO does not hash to their id, Neuron modules marked done with an empty NEFF."""
    problems = []
    for path, entry in local_entries(root).items():
        if entry.is_file:
            continue
        record_file = entry.location / ENTRY_RECORD
        if record_file.is_file():
            record = json.loads(record_file.read_text())
            for name, want in record["files"].items():
                p = entry.location / name
                if not p.is_file():
                    problems.append({"entry": path, "file": name, "problem": "missing"})
                elif p.stat().st_size != want["size"]:
                    problems.append(
                        {
                            "entry": path,
                            "file": name,
                            "problem": f"truncated or extended ({p.stat().st_size} of {want['size']} bytes)",
                        }
                    )
                elif sha256_file(p) != want["sha256"]:
                    problems.append({"entry": path, "file": name, "problem": "altered (sha256 mismatch)"})
        if path.startswith("graphs/") and (entry.location / "model.hlo.txt").is_file():
            if graph_id((entry.location / "model.hlo.txt").read_text()) != entry.location.name:
                problems.append(
                    {"entry": path, "file": "model.hlo.txt", "problem": "HLO does not hash to its graph id"}
                )
        if "/MODULE_" in path and (entry.location / "model.neff").stat().st_size == 0:
            problems.append({"entry": path, "file": "model.neff", "problem": "empty NEFF marked done"})
    return problems


def parse_duration(text: str) -> float:
    """'30d', '12h', '45m', '90s' -> seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if not m:
        raise UsageError(f"bad duration {text!r} (use e.g. 30d, 12h, 45m)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]


def run_parallel(fn: Callable, items: Iterable, workers: int, desc: str, unit: str = "obj") -> list:
    """Map fn over items with `workers` threads and a progress bar; results in input order."""
    items = list(items)
    if not items:
        return []
    with (
        ThreadPoolExecutor(max_workers=max(1, workers)) as pool,
        tqdm(total=len(items), desc=desc, unit=unit, disable=None, file=sys.stderr) as bar,
    ):
        futures = [pool.submit(fn, item) for item in items]
        results = []
        for fut in futures:
            results.append(fut.result())
            bar.update(1)
    return results
