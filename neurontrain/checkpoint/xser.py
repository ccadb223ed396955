"""torch-xla's serialization ("xser"), which NxD's `save_checkpoint(use_xser=True)` writes and optimum-neuron uses
by default: a rank file `X.pt` is a torch.save of the state dict with each tensor replaced by a
`torch_xla.utils.serialization.TensorReference(tid)`, each tensor is its own torch.save in
`X.pt.tensors/tensor_<tid>.pt`, and `X.pt.info.pt` maps each tid to its dtype and shape (NxD's broadcast
loading reads it).

Read lazily, a tensor at a time (memory-mapped), and written without importing torch-xla (seconds to import): the
reference class is named in the pickle as torch-xla names it, and read back as a plain holder of its tid.
"""

from __future__ import annotations

import pickle
import types
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from neurontrain.checkpoint.formats import load_torch_file
from neurontrain.errors import UsageError

_XSER_MODULE, _XSER_CLASS = "torch_xla.utils.serialization", "TensorReference"
_ALLOWED = {
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("torch", "Size"),
    ("torch._utils", "_rebuild_tensor_v2"),  # tensors torch-xla's save left inline: it rewrites only XLA tensors
    ("torch._utils", "_rebuild_parameter"),
}


class TensorReference:
    """A tensor's place in the rank file's `.tensors` folder (torch-xla's class, by the same pickled state)."""

    def __init__(self, tid: int) -> None:
        self.tid = tid


def tensors_folder(path: Path) -> Path:
    return path.parent / (path.name + ".tensors")


def is_xser(path: Path) -> bool:
    return tensors_folder(path).is_dir()


class _RefPickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden
    def save_global(self, obj, name=None):
        if obj is TensorReference:
            self.write(pickle.GLOBAL + f"{_XSER_MODULE}\n{_XSER_CLASS}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)


class _RefUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == (_XSER_MODULE, _XSER_CLASS):
            return TensorReference
        if (module, name) in _ALLOWED or (module == "torch" and name.endswith("Storage")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of an xser state dict")


def _pickle_module(pickler: type) -> types.ModuleType:
    module = types.ModuleType("xser_pickle")  # torch.save / torch.load take a pickle module
    module.Pickler, module.Unpickler, module.load = pickler, _RefUnpickler, pickle.load
    return module


_WRITING, _READING = _pickle_module(_RefPickler), _pickle_module(pickle.Pickler)


def save_xser(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One rank file in xser form, as NxD's `_save(use_xser=True)` lays it out (tids in the dict's order)."""
    folder = tensors_folder(path)
    folder.mkdir()
    refs, info = {}, {}
    for tid, (name, tensor) in enumerate(tensors.items()):
        torch.save(tensor, folder / f"tensor_{tid}.pt")
        refs[name] = TensorReference(tid)
        info[tid] = {"dtype": tensor.dtype, "shape": tensor.shape, "expert_model_parallel": False}
    torch.save(refs, path, pickle_module=_WRITING)
    torch.save(info, path.parent / (path.name + ".info.pt"))


class XserFile(Mapping):
    """A rank file's {name: tensor}, each tensor loaded (memory-mapped) when first asked for."""

    def __init__(self, path: Path) -> None:
        self.path, self.folder = path, tensors_folder(path)
        try:
            refs = torch.load(path, map_location="cpu", pickle_module=_READING, weights_only=False)
        except Exception as exc:
            raise UsageError(f"{path} is not a readable xser checkpoint ({type(exc).__name__}: {exc})") from None
        if isinstance(refs, dict) and isinstance(refs.get("model"), dict):
            refs = refs["model"]
        if not isinstance(refs, dict) or not all(isinstance(r, TensorReference | torch.Tensor) for r in refs.values()):
            raise UsageError(f"{path} does not hold a mapping of tensor names to xser tensor references")
        self._refs: dict[str, TensorReference | torch.Tensor] = refs
        self._loaded: dict[str, torch.Tensor] = {n: t for n, t in refs.items() if isinstance(t, torch.Tensor)}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._loaded:
            tensor_file = self.folder / f"tensor_{self._refs[name].tid}.pt"
            if not tensor_file.is_file():
                raise UsageError(f"{self.path}: {tensor_file.name} of {name} is missing")
            tensor = load_torch_file(tensor_file)
            if not isinstance(tensor, torch.Tensor):
                raise UsageError(f"{tensor_file} does not hold a tensor")
            self._loaded[name] = tensor
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)
