"""TorchNeuron's NEFF cache kept with the native backend's cache entry, so it is shared and verified like the rest.

TorchNeuron's `neuron` torch.compile backend keeps the NEFFs it compiles in the directory
`TORCH_NEURONX_NEFF_CACHE_DIR` names (default under /tmp: lost with the instance) and registers them with
`torch.compiler.save_cache_artifacts` (Neuron's torch.compile backend reference, "caching configuration", and its
environment variable reference). Here that directory is `<runtime.compile_cache>/torchneuron-neff` unless the
user's environment names one; the entry of a plan (compile/native_cache.py) carries the directory's files as one
archive, `neff.tar`, under the entry's sha256 record: pulled, pushed and verified through the same store as the
XLA cache. What TorchNeuron writes inside the directory is its own business: the archive keeps it byte for byte.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import MutableMapping
from pathlib import Path

NEFF_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
NEFF_ARCHIVE = "neff.tar"
NEFF_DIR = "torchneuron-neff"  # under the local cache root; not an entry of the store


def point_neff_cache(env: MutableMapping[str, str], cache_root: Path) -> Path:
    """The NEFF cache directory TorchNeuron will use: the user's TORCH_NEURONX_NEFF_CACHE_DIR if set, else one
    under the compile cache (set in `env` before TorchNeuron first compiles)."""
    if env.get(NEFF_ENV):
        return Path(env[NEFF_ENV])
    directory = cache_root / NEFF_DIR
    directory.mkdir(parents=True, exist_ok=True)
    env[NEFF_ENV] = str(directory)
    return directory


def neff_files(directory: Path) -> list[str]:
    """Files under the NEFF cache directory, relative and sorted (what a compile adds to)."""
    if not directory.is_dir():
        return []
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def archive_neffs(directory: Path) -> bytes:
    """The directory's files as one uncompressed tar (NEFFs are already dense), in a stable order."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in neff_files(directory):
            tar.add(directory / name, arcname=name, recursive=False)
    return out.getvalue()


def restore_neffs(archive: Path, directory: Path) -> int:
    """Unpack a verified entry's archive into the NEFF cache directory (files already there stay); returns the
    files written. Members outside the directory are refused (tarfile's `data` filter)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = 0
    with tarfile.open(archive, mode="r") as tar:
        for member in tar.getmembers():
            if member.isfile() and not (directory / member.name).exists():
                tar.extract(member, directory, filter="data")
                written += 1
    return written
