"""Checkpoints written by a newer torch than the one installed: what still reads, and one line for what does not.

What a newer release can write that this torch reads: DCP metadata with fields this torch does not know
(pickled dataclasses restore every field they carry), a newer DCP format of the same major version, torch.save
archives with records this torch does not know. What it cannot: a pickle naming a torch class, function or module
this torch lacks, a DCP format of a newer major version (its loader may lay tensors out differently: reading it
would be silently wrong), a torch.save archive whose format version exceeds the one this torch reads. For those
the line names what the files record (the DCP format version, the archive version, the missing name) and what
to do: save the tensors with safetensors in the torch that wrote them, which any release reads.
"""

from __future__ import annotations

import importlib
import pickle
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from neurontrain.errors import UsageError, first_line

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

_RESAVE = "in the torch that wrote it, save its tensors with safetensors.torch.save_file and migrate that file"
_RESAVE_DCP = (
    "in the torch that wrote it, read it with torch.distributed.checkpoint.format_utils.dcp_to_torch_save, "
    "save those tensors with safetensors.torch.save_file and migrate that file"
)
_ARCHIVE_VERSION = re.compile(
    r"PyTorch file with version (\d+), but the maximum supported version for reading is (\d+)"
)
_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
_MISSING_ATTRIBUTE = re.compile(r"Can't get attribute '([\w.]+)' on <module '([\w.]+)'")


def _absent_from_torch(dotted: str) -> bool:
    """A torch.* name that this torch does not have."""
    module, _, attribute = dotted.rpartition(".")
    if module.split(".")[0] != "torch":
        return False
    try:
        return not hasattr(importlib.import_module(module), attribute)
    except ImportError:
        return True


def missing_torch_name(exc: BaseException) -> str | None:
    """The torch module, class or function a pickle names and this torch lacks, from the error reading it."""
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "torch":
        return exc.name
    text = str(exc)
    found = _MISSING_ATTRIBUTE.search(text)
    if found and found.group(2).split(".")[0] == "torch":
        return f"{found.group(2)}.{found.group(1)}"
    found = _UNSUPPORTED_GLOBAL.search(text)
    if found and _absent_from_torch(found.group(1)):
        return found.group(1)
    return None


def newer_torch_file(path: Path, exc: BaseException) -> str | None:
    """The line for a torch.save file a newer torch wrote, or None if the error says nothing of a newer writer."""
    found = _ARCHIVE_VERSION.search(str(exc))
    if found:
        return (
            f"{path} was written by a newer torch than {torch.__version__} (archive format version {found.group(1)}; "
            f"this torch reads up to {found.group(2)}): {_RESAVE}"
        )
    name = missing_torch_name(exc)
    if name:
        return (
            f"{path} was written by a newer torch than {torch.__version__} (it names {name}, which this torch "
            f"lacks): {_RESAVE}"
        )
    return None


class _Unknown:
    """Stands for a class this torch lacks, keeping the fields pickled into it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.__dict__.update(state)


class _TolerantUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        try:
            return super().find_class(module, name)
        except (AttributeError, ImportError):
            return _Unknown


def _recorded_dcp_version(directory: Path) -> str | None:
    """The DCP format version a .metadata records (Metadata.version; torch 2.9 writes 1.0.0), read past the
    classes this torch lacks; None where it records none or cannot be read at all."""
    try:
        with open(directory / ".metadata", "rb") as f:
            version = getattr(_TolerantUnpickler(f).load(), "version", None)
    except Exception:  # only a detail for the message: an unreadable file is reported by the caller
        return None
    return str(version) if version is not None else None


def _major(version: object) -> int | None:
    found = re.match(r"\s*(\d+)", str(version)) if version is not None else None
    return int(found.group(1)) if found else None


def read_dcp_metadata(directory: Path) -> Metadata:
    """A DCP directory's metadata, or a UsageError of one line: which newer torch wrote it and what to do."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem  # lazy: DCP sources only
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:
        name = missing_torch_name(exc)
        if name is None:
            raise UsageError(
                f"{directory} is not a readable DCP checkpoint ({type(exc).__name__}: {first_line(exc, 100)}); "
                f"if a newer torch than {torch.__version__} wrote it, {_RESAVE_DCP}"
            ) from None
        recorded = _recorded_dcp_version(directory)
        fmt = f"DCP format {recorded}, " if recorded else ""
        raise UsageError(
            f"{directory} was written by a newer torch than {torch.__version__} ({fmt}its .metadata names {name}, "
            f"which this torch lacks): {_RESAVE_DCP}"
        ) from None
    recorded, current = getattr(metadata, "version", None), getattr(dcp_filesystem, "CURRENT_DCP_VERSION", None)
    if _major(recorded) is not None and _major(current) is not None and _major(recorded) > _major(current):
        raise UsageError(
            f"{directory} was written by a newer torch than {torch.__version__} (DCP format {recorded}; this torch "
            f"writes {current} and reads no newer major version): {_RESAVE_DCP}"
        )
    return metadata
