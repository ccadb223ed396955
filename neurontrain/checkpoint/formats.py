"""Lazy readers of the files checkpoints are made of, exposing full tensors under the names found in them.

Readers: safetensors files (one or sharded), torch `.pt`/`.bin`/`.ckpt` files (a state dict, or a training
checkpoint dict holding one under model/state_dict/model_state_dict/module), torch.distributed.checkpoint (DCP)
directories (the model under any top-level key; optimizer namespaces kept apart). Wrapper prefixes (`module.`,
`_orig_mod.`, `_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`) are removed from the names; which part of
a name is the model's is decided later by matching the model (matching.py), never guessed here. Which tool
wrote a checkpoint, and so which reader reads it, is layouts.py. Tensors are read one at a time (safetensors
per tensor, torch files memory-mapped, DCP per key), never the whole model. Files a newer torch wrote:
newer_writers.py.
"""

from __future__ import annotations

import math
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from neurontrain.checkpoint.mapped import MappedFiles, narrowed, nbytes
from neurontrain.checkpoint.newer_writers import newer_torch_file, read_dcp_metadata
from neurontrain.errors import UsageError, first_line
from neurontrain.logs import get_logger
from neurontrain.parallel.rules import Piece, with_zero_rows

log = get_logger(__name__)

_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
_INNER = ("._orig_mod.", "._fsdp_wrapped_module.", "._checkpoint_wrapped_module.")
# top-level keys of training checkpoints that hold the model, in the order they are tried
MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")
OPTIMIZER_KEYS = ("optimizer", "optim", "optimizer_state_dict", "optimizer_states")
# DCP namespaces of optimizer state: optimizer, optim, optimizer_0 (Lightning), optimizers ...
_OPTIM_NAMESPACE = re.compile(r"^optim(izer)?s?(_state_dict|_states)?(_?\d+)?$")


class TensorSource(Protocol):
    description: str
    config: dict | None
    layout: str  # what inspect reports: dcp, lightning, hf-trainer, ...
    writer: str  # the tool that writes this layout

    def keys(self) -> list[str]: ...
    def get(self, name: str) -> torch.Tensor: ...
    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """An owned copy of indices [start, stop) of `dim`, reading no more of the tensor than the source must."""
        ...

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]: ...
    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None: ...


def read_piece(source: TensorSource, name: str, piece: Piece) -> torch.Tensor:
    """A rank's piece of a tensor, read by slice (the tensor itself for a replicated one)."""
    if piece.dim is None:
        return source.get(name)
    parts = [source.get_slice(name, piece.dim, start, stop) for start, stop in piece.ranges]
    return with_zero_rows(piece, parts[0] if len(parts) == 1 else torch.cat(parts, dim=piece.dim))


def clean_name(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
        for inner in _INNER:
            name = name.replace(inner, ".")
    return name


def load_torch_file(path: Path) -> object:
    """The file's object with its tensors memory-mapped; files of torch's legacy (pre-zip) serialization cannot
    be mapped and are loaded whole (the log says so)."""
    try:
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as exc:
            if "mmap can only be used" not in str(exc):
                raise
            whole = torch.load(path, map_location="cpu", weights_only=True)
            log.warning("%s is in torch's legacy serialization, which cannot be memory-mapped: loaded it whole", path)
            return whole
    except Exception as exc:
        newer = newer_torch_file(path, exc)
        if newer:
            raise UsageError(newer) from None
        hint = ""
        if "Unsupported global" in str(exc) or "weights_only" in str(exc):
            hint = "; it pickles objects other than tensors and plain containers, which are not loaded"
        raise UsageError(
            f"{path} is not a readable torch checkpoint ({type(exc).__name__}: {first_line(exc, 120)}){hint}"
        ) from None


def optimizer_by_name(state: dict, order: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """torch optimizer state dict ({state: {index: {...}}, param_groups}) -> {parameter name: {...}}; `order`
    names the parameters when the groups carry no param_names."""
    groups = state.get("param_groups", [])
    names: list[str] = []
    indices: list = []
    for group in groups:
        indices += list(group["params"])
        names += [clean_name(n) for n in group.get("param_names", [])]
    if all(isinstance(i, str) for i in indices) and indices:  # already keyed by name (FSDP full optim dicts)
        names = [clean_name(i) for i in indices]
    if not names:
        names = order
    if len(names) != len(indices):
        raise UsageError(f"optimizer state covers {len(indices)} parameters, the model has {len(names)}")
    return {name: dict(state["state"][idx]) for name, idx in zip(names, indices) if idx in state["state"]}


def _torch_optimizer(obj: object) -> dict | None:
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):  # Lightning: optimizer_states = [state]
        obj = obj[0]
    return obj if isinstance(obj, dict) and "state" in obj else None


def optimizer_in(obj: object) -> dict | None:
    """The torch-form optimizer state a file's object is, or holds under one of OPTIMIZER_KEYS."""
    found = _torch_optimizer(obj)
    if found is None and isinstance(obj, dict):
        found = next((o for k in OPTIMIZER_KEYS if (o := _torch_optimizer(obj.get(k))) is not None), None)
    return found


class _OptimizerFromTorch:
    """A torch-form optimizer state dict (read when first asked for), named by param_names or by the order
    of the checkpoint's names."""

    _optimizer: dict | None = None
    _optimizer_file: Path | None = None

    @property
    def optimizer(self) -> dict | None:
        if self._optimizer is None and self._optimizer_file is not None:
            self._optimizer = optimizer_in(load_torch_file(self._optimizer_file))
            self._optimizer_file = None
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value: dict | None) -> None:
        self._optimizer = value

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        if self.optimizer is None:
            return None
        return optimizer_by_name(self.optimizer, self.keys())

    def load_optimizer_file(self, path: Path | None) -> None:
        """The optimizer state in a file beside the weights (optimizer.pt, optimizer.bin), if there is one."""
        if path is not None and path.is_file():
            self._optimizer_file = path


class SafetensorsSource(_OptimizerFromTorch):
    """Safetensors files, read by tensor or by slice. Every read opens its file and closes it again: safetensors
    memory-maps the file, and the pages a read touches stay resident in this process until the file is closed
    (slicing eight 117 MB tensors through one open file kept 0.9 GB resident, through one open per read none)."""

    ROW_BLOCK_BYTES = 64 << 20  # a column slice is read this many bytes of whole rows at a time

    def __init__(self, files: list[Path], config: dict | None, description: str, layout: str, writer: str) -> None:
        self.description, self.config, self.layout, self.writer = description, config, layout, writer
        self._where: dict[str, tuple[Path, str]] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for f in files:
            with _open_safetensors(f) as handle:
                for key in handle.keys():
                    name = clean_name(key)
                    if name not in self._where:
                        piece = handle.get_slice(key)
                        self._where[name] = (f, key)
                        dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype(), torch.uint8)
                        self._meta[name] = tuple(piece.get_shape()), dtype

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        f, key = self._where[name]
        with _reading(f, key) as handle:
            return handle.get_tensor(key)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices [start, stop) of `dim`, reading only those rows (dim 0) or, a block of rows at a time, those
        rows' indices of a later dim."""
        f, key = self._where[name]
        shape, dtype = self._meta[name]
        if dim == 0:
            with _reading(f, key) as handle:
                return handle.get_slice(key)[start:stop].clone()
        out = torch.empty((*shape[:dim], stop - start, *shape[dim + 1 :]), dtype=dtype)
        row_bytes = max(1, math.prod(shape[1:]) * dtype.itemsize)
        block = max(1, self.ROW_BLOCK_BYTES // row_bytes)
        between = (slice(None),) * (dim - 1)
        for first in range(0, shape[0], block):
            with _reading(f, key) as handle:
                out[first : first + block] = handle.get_slice(key)[
                    (slice(first, first + block), *between, slice(start, stop))
                ]
        return out

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self._meta[name]


def _open_safetensors(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for truncated/foreign files
        raise UsageError(f"{path} is not a readable safetensors file ({first_line(exc, 120)})") from None


@contextmanager
def _reading(path: Path, key: str):
    with _open_safetensors(path) as handle:
        try:
            yield handle
        except UsageError:
            raise
        except Exception as exc:
            raise UsageError(f"{path}: cannot read tensor {key} ({first_line(exc, 120)})") from None


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def unwrap(obj: object, path: Path) -> tuple[dict, dict | None]:
    """(state dict, torch-form optimizer state or None) from a torch checkpoint's top-level object."""
    optimizer = optimizer_in(obj) if isinstance(obj, dict) else None
    if isinstance(obj, dict):
        for key in MODEL_KEYS:
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(k, str) for k in obj):
        raise UsageError(f"{path} does not hold a state dict (a mapping of names to tensors)")
    tensors: dict[str, torch.Tensor] = {}
    for k, v in obj.items():
        if isinstance(v, torch.Tensor):
            tensors.setdefault(clean_name(k), v)
    if not tensors:
        raise UsageError(f"{path} holds no tensors")
    return tensors, optimizer


class TorchSource(_OptimizerFromTorch):
    """torch files (state dicts or training checkpoints), memory-mapped and let go again as they are read
    (MappedFiles). `top`: the first file's object when it is loaded already; `remappable` False: tensors built in
    memory, kept as they are. An optimizer state in a file is loaded again when asked for, so that it does not
    keep the file's weights mapped."""

    def __init__(
        self,
        files: list[Path],
        config: dict | None,
        description: str,
        layout: str = "torch",
        writer: str = "torch.save",
        top: object | None = None,
        remappable: bool = True,
    ) -> None:
        self.description, self.config, self.layout, self.writer = description, config, layout, writer
        self._file_of: dict[str, Path] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._pinned: dict[str, torch.Tensor] | None = None
        self._mapped = MappedFiles(lambda f: unwrap(load_torch_file(f), f)[0])
        for i, f in enumerate(files):
            tensors, optimizer = unwrap(top if top is not None and i == 0 else load_torch_file(f), f)
            for name, tensor in tensors.items():
                self._file_of[name], self._meta[name] = f, (tuple(tensor.shape), tensor.dtype)
            if not remappable:
                self._pinned, self.optimizer = tensors, optimizer
            elif optimizer is not None and self._optimizer_file is None:
                self._optimizer_file = f

    def keys(self) -> list[str]:
        return list(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        if self._pinned is not None:
            return self._pinned[name]
        tensor = self._mapped[self._file_of[name]][name]
        self._mapped.read(nbytes(tensor))
        return tensor

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return narrowed(self.get(name), dim, start, stop)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self._meta[name]


def is_optimizer_key(key: str) -> bool:
    return bool(_OPTIM_NAMESPACE.match(key.split(".", 1)[0]))


class DCPSource:
    """torch.distributed.checkpoint directory, read one tensor at a time without a process group. Tensors under
    an optimizer namespace are optimizer state (`<ns>.state.<parameter>.<exp_avg|exp_avg_sq|step>`)."""

    def __init__(self, directory: Path, config: dict | None, layout: str = "dcp", writer: str = "") -> None:
        self.description, self.config, self.directory = f"DCP {directory}", config, directory
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # lazy: DCP sources only

        self.layout, self.writer = layout, writer or "torch.distributed.checkpoint (dcp.save)"
        metadata = read_dcp_metadata(directory)
        self._meta = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self._names: dict[str, str] = {}
        for k in self._meta:
            if not is_optimizer_key(k):
                self._names.setdefault(clean_name(k), k)
        self.optimizer_keys = [k for k in self._meta if is_optimizer_key(k)]

    def keys(self) -> list[str]:
        return list(self._names)

    def _load(self, key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp  # lazy: DCP sources only

        meta = self._meta[key]
        out = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(out, checkpoint_id=str(self.directory))
        return out[key]

    def get(self, name: str) -> torch.Tensor:
        return self._load(self._names[name])

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return narrowed(self.get(name), dim, start, stop)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        meta = self._meta[self._names[name]]
        return tuple(meta.size), meta.properties.dtype

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """{parameter name as the optimizer knows it: {moment: tensor}} from the name-keyed form."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for key in self.optimizer_keys:
            rest = key.split(".", 1)[1] if "." in key else ""
            if rest.startswith("state.") and "." in rest[6:]:
                parameter, moment = rest[6:].rsplit(".", 1)
                out.setdefault(clean_name(parameter), {})[moment] = self._load(key)
        return out or None
