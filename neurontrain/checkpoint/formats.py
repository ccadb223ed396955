"""Lazy readers of checkpoints in every supported format, all exposing full tensors under Hugging Face names.

GPU side: Hugging Face directories (model.safetensors, sharded safetensors with an index, pytorch_model.bin
[sharded]), torch `.pt`/`.bin` state dicts (nested under model/state_dict, `module.` / `_orig_mod.` /
`_fsdp_wrapped_module.` prefixes, CUDA tensors), FSDP full state dicts, torch.distributed.checkpoint (DCP)
directories. Trainium side: the toolkit's training checkpoints and NxD per-rank shards (checkpoint/nxd.py).
Tensors are read one at a time (safetensors per tensor, torch files memory-mapped), never the whole model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from neurontrain.errors import UsageError, first_line

_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


class TensorSource(Protocol):
    description: str
    config: dict | None

    def keys(self) -> list[str]: ...
    def get(self, name: str) -> torch.Tensor: ...
    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None: ...


def clean_name(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
        name = name.replace("._fsdp_wrapped_module.", ".").replace("._checkpoint_wrapped_module.", ".")
    return name


def _read_config(directory: Path) -> dict | None:
    path = directory / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            raise UsageError(f"{path} is not valid JSON") from None
    return None


class SafetensorsSource:
    def __init__(self, files: list[Path], config: dict | None, description: str) -> None:
        self.description, self.config = description, config
        self._where: dict[str, tuple[Path, str]] = {}
        self._handles = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for truncated/foreign files
                raise UsageError(f"{f} is not a readable safetensors file ({first_line(exc, 120)})") from None
            self._handles[f] = handle
            for key in handle.keys():
                self._where[clean_name(key)] = (f, key)

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        f, key = self._where[name]
        try:
            return self._handles[f].get_tensor(key)
        except Exception as exc:
            raise UsageError(f"{f}: cannot read tensor {key} ({first_line(exc, 120)})") from None

    def optimizer_state(self) -> None:
        return None


def load_torch_file(path: Path) -> object:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:
        raise UsageError(
            f"{path} is not a readable torch checkpoint ({type(exc).__name__}: {first_line(exc, 120)})"
        ) from None


def _unwrap(obj: object, path: Path) -> tuple[dict, dict | None]:
    """(state dict, optimizer state dict or None) from a torch checkpoint's top-level object."""
    optimizer = None
    if isinstance(obj, dict):
        optimizer = obj.get("optimizer") or obj.get("optim") or obj.get("optimizer_state_dict")
        for key in ("model", "state_dict", "model_state_dict", "module"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(k, str) for k in obj):
        raise UsageError(f"{path} does not hold a state dict (a mapping of names to tensors)")
    tensors = {clean_name(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise UsageError(f"{path} holds no tensors")
    return tensors, optimizer if isinstance(optimizer, dict) else None


class TorchSource:
    def __init__(
        self, files: list[Path], config: dict | None, description: str, param_order: list[str] | None = None
    ) -> None:
        self.description, self.config = description, config
        self._tensors: dict[str, torch.Tensor] = {}
        self._optimizer = None
        for f in files:
            tensors, optimizer = _unwrap(load_torch_file(f), f)
            self._tensors.update(tensors)
            self._optimizer = self._optimizer or optimizer
        self._param_order = param_order

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        if self._optimizer is None:
            return None
        return optimizer_by_name(self._optimizer, self._param_order or self._default_order())

    def _default_order(self) -> list[str]:
        """The toolkit's AdamW grouping: matrices (weight decay) first, then vectors, each in model order; tied
        tensors count once."""
        seen, names = set(), []
        for name, t in self._tensors.items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key not in seen:
                seen.add(key)
                names.append(name)
        return [n for n in names if self._tensors[n].ndim >= 2] + [n for n in names if self._tensors[n].ndim < 2]


def optimizer_by_name(state: dict, order: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """torch optimizer state dict ({state: {index: {...}}, param_groups}) -> {parameter name: {...}}."""
    groups = state.get("param_groups", [])
    names: list[str] = []
    indices: list[int] = []
    for group in groups:
        indices += list(group["params"])
        names += [clean_name(n) for n in group.get("param_names", [])]
    if not names:
        names = order
    if len(names) != len(indices):
        raise UsageError(f"optimizer state covers {len(indices)} parameters, the model has {len(names)}")
    return {name: dict(state["state"][idx]) for name, idx in zip(names, indices) if idx in state["state"]}


class DCPSource:
    """torch.distributed.checkpoint directory, read one tensor at a time without a process group."""

    def __init__(self, directory: Path, config: dict | None) -> None:
        self.description, self.config, self.directory = f"DCP {directory}", config, directory
        try:
            metadata = FileSystemReader(str(directory)).read_metadata()
        except Exception as exc:
            raise UsageError(f"{directory} is not a readable DCP checkpoint ({type(exc).__name__})") from None
        self._meta = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        model_keys = [k for k in self._meta if k.startswith("model.")]
        self._prefix = "model." if model_keys and len(model_keys) == len(self._meta) else ""
        self._names = {clean_name(k[len(self._prefix) :]): k for k in self._meta}

    def keys(self) -> list[str]:
        return list(self._names)

    def get(self, name: str) -> torch.Tensor:
        key = self._names[name]
        meta = self._meta[key]
        out = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(out, checkpoint_id=str(self.directory))
        return out[key]

    def optimizer_state(self) -> None:
        return None


def open_gpu_checkpoint(path: Path, config_path: Path | None = None) -> TensorSource:
    """Any GPU-side checkpoint: a HF directory, a DCP directory, a torch/safetensors file."""
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    config = _read_config(
        config_path if config_path and config_path.is_dir() else path if path.is_dir() else path.parent
    )
    if config_path and config_path.is_file():
        config = json.loads(config_path.read_text())
    if path.is_dir():
        index = next(
            (p for p in (path / "model.safetensors.index.json", path / "pytorch_model.bin.index.json") if p.is_file()),
            None,
        )
        if index is not None:
            try:
                files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
            except (json.JSONDecodeError, KeyError):
                raise UsageError(f"{index} is not a valid weight index") from None
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise UsageError(f"{index} names a missing shard {missing[0].name}")
            cls = SafetensorsSource if index.name.startswith("model.safetensors") else TorchSource
            return cls(files, config, f"HF sharded {path}")
        if (path / "model.safetensors").is_file():
            return SafetensorsSource([path / "model.safetensors"], config, f"HF {path}")
        if (path / "pytorch_model.bin").is_file():
            return TorchSource([path / "pytorch_model.bin"], config, f"HF {path}")
        if (path / ".metadata").is_file():
            return DCPSource(path, config)
        raise UsageError(f"{path}: no model.safetensors, pytorch_model.bin, weight index or DCP .metadata found")
    if path.suffix == ".safetensors":
        return SafetensorsSource([path], config, f"safetensors {path}")
    return TorchSource([path], config, f"torch {path}")
