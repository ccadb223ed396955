"""The tokenized store: each split's token ids as one flat file plus offsets (and labels, and for SFT data a loss
mask of a byte a token, `<split>.mask`), built once per content
and memory-mapped by every process that trains on it.

An entry is a directory `<root>/<key>` whose key is a digest of everything that changes the ids (the data source
and its file's identity, the tokenizer, data.max_length and data.overlong, the sample counts): `meta.json` (written
last) names the key's material and each file's size and BLAKE2b digest. Opening checks them all, so an entry that is
corrupt (a file cut short or changed) or foreign (another key's material) is refused and rebuilt, never used.

One process builds an entry while the others wait on a file lock (`fcntl.flock`), then open what it published: on a
node, the launcher (or the first worker) tokenizes and the other workers map the same files, which share the page
cache. The root: $NEURONTRAIN_DATA_CACHE, else $XDG_CACHE_HOME/neurontrain/data (~/.cache/...).
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neurontrain.data.token_seqs import TokenSeqs
from neurontrain.logs import get_logger

log = get_logger(__name__)

FORMAT = 1
META = "meta.json"
SPLITS = ("train", "eval")


def store_root() -> Path:
    explicit = os.environ.get("NEURONTRAIN_DATA_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "neurontrain" / "data"


def store_key(material: dict) -> str:
    text = json.dumps({"format": FORMAT, "material": material}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


class SplitWriter:
    """Appends one split's samples chunk by chunk: tokens to `<split>.tokens`, lengths (and labels) kept as small
    arrays until `finish` writes the offsets."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype) -> None:
        self.directory, self.split, self.dtype = directory, split, dtype
        self._tokens = open(directory / f"{split}.tokens", "wb")  # noqa: SIM115 - closed in finish
        self._lengths: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._masks = None  # `<split>.mask`: a byte a token (1: in the loss), opened by the first masked chunk

    def append(self, samples: list, labels: list[int] | None, masks: list | None = None) -> None:
        lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
        if len(samples):
            flat = np.fromiter(itertools.chain.from_iterable(samples), dtype=self.dtype, count=int(lengths.sum()))
            self._tokens.write(flat.tobytes())
        if masks is not None:
            if self._masks is None:
                self._masks = open(self.directory / f"{self.split}.mask", "wb")  # noqa: SIM115 - closed in finish
            bits = np.fromiter(itertools.chain.from_iterable(masks), dtype=np.uint8, count=int(lengths.sum()))
            self._masks.write(bits.tobytes())
        self._lengths.append(lengths)
        if labels is not None:
            self._labels.append(np.asarray(labels, dtype=np.int64))

    def finish(self, masked: bool = False) -> dict:
        """Close the files; `masked`: the split has a loss mask (written empty where no chunk had a sample)."""
        self._tokens.close()
        if masked and self._masks is None:
            self._masks = open(self.directory / f"{self.split}.mask", "wb")  # noqa: SIM115 - closed below
        if self._masks is not None:
            self._masks.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        np.save(self.directory / f"{self.split}.offsets.npy", offsets)
        out = {"samples": int(len(lengths)), "tokens": int(offsets[-1]), "dtype": self.dtype.str, "labels": False}
        out["masks"] = self._masks is not None
        if self._labels:
            np.save(self.directory / f"{self.split}.labels.npy", np.concatenate(self._labels))
            out["labels"] = True
        return out


@dataclass
class StoredSplit:
    ids: TokenSeqs
    labels: list[int] | None
    masks: TokenSeqs | None = None  # each sample's loss mask, over the same starts and lengths as `ids`


@dataclass
class StoreEntry:
    path: Path
    meta: dict
    built: bool  # this process tokenized it (False: an earlier run, or another process, did)

    def split(self, name: str) -> StoredSplit:
        info = self.meta["splits"][name]
        tokens_file = self.path / f"{name}.tokens"
        dtype = np.dtype(info["dtype"])
        tokens = (
            np.memmap(tokens_file, dtype=dtype, mode="r", shape=(info["tokens"],))
            if info["tokens"]
            else np.zeros(0, dtype=dtype)
        )
        offsets = np.load(self.path / f"{name}.offsets.npy")
        labels = np.load(self.path / f"{name}.labels.npy").tolist() if info["labels"] else None
        ids = TokenSeqs.from_offsets(tokens, offsets)
        masks = None
        if info.get("masks"):
            bits = (
                np.memmap(self.path / f"{name}.mask", dtype=np.uint8, mode="r", shape=(info["tokens"],))
                if info["tokens"]
                else np.zeros(0, dtype=np.uint8)
            )
            masks = TokenSeqs(bits, ids.starts, ids.lengths)  # the same lengths: a cut of the ids cuts the mask
        return StoredSplit(ids, labels, masks)


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _data_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name != META)


def check_entry(path: Path, key: str, material: dict) -> str | None:
    """Why the entry at `path` cannot be used (None: it can)."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return "no readable meta.json (an interrupted build?)"
    if meta.get("format") != FORMAT or meta.get("key") != key or meta.get("material") != material:
        return "it was built for other data or settings"
    files = meta.get("files", {})
    present = {p.name: p for p in _data_files(path) if p.parent == path}
    if set(present) != set(files):
        return f"its files differ from the ones it lists ({sorted(set(present) ^ set(files))})"
    for name, expected in files.items():
        if present[name].stat().st_size != expected["bytes"] or _digest(present[name]) != expected["blake2b"]:
            return f"{name} does not match its digest"
    return None


@contextmanager
def _locked(root: Path, key: str, mode: int) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "a") as fh:
        fcntl.flock(fh, mode)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _publish(building: Path, final: Path, key: str, material: dict, built: dict) -> None:
    files = {p.name: {"bytes": p.stat().st_size, "blake2b": _digest(p)} for p in _data_files(building)}
    meta = {"format": FORMAT, "key": key, "material": material, "files": files} | built
    (building / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
    os.replace(building, final)


def open_or_build(material: dict, build: Callable[[Path], dict[str, Any]]) -> StoreEntry:
    """The entry for `material`: opened when a valid one exists, else built by `build(directory)` (which writes the
    splits and returns what meta.json records besides the files) and published. Processes asking for the same
    entry at once wait for the one that builds it."""
    root, key = store_root(), store_key(material)
    final = root / key
    with _locked(root, key, fcntl.LOCK_SH):  # readers check side by side
        if final.exists() and check_entry(final, key, material) is None:
            return StoreEntry(final, json.loads((final / META).read_text()), built=False)
    with _locked(root, key, fcntl.LOCK_EX):
        if final.exists():
            problem = check_entry(final, key, material)
            if problem is None:  # another process built it while this one waited
                return StoreEntry(final, json.loads((final / META).read_text()), built=False)
            log.warning(f"tokenized data {final}: {problem}; tokenizing again")
            shutil.rmtree(final)
        building = root / f"{key}.building-{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir()
        started = time.perf_counter()
        try:
            built = build(building)
            built["build_seconds"] = round(time.perf_counter() - started, 2)
            _publish(building, final, key, material, built)
        finally:
            shutil.rmtree(building, ignore_errors=True)
        return StoreEntry(final, json.loads((final / META).read_text()), built=True)
