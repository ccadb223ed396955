"""The stand-in's device memory (device.cpp), built with torch's own extension builder the first time a process
asks for it and then loaded from the build directory: a directory named by the source's hash under torch's
extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), so a machine compiles it once."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

SOURCE = Path(__file__).with_name("device.cpp")
FLAGS = ["-O1"]  # the kernels are a handful of copies: optimising them buys nothing and costs compile time
_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_kept: list = []  # the ctypes callback and the library, alive as long as the process


def compiler_missing() -> str | None:
    """Why the device cannot be built here (no C++ compiler or no ninja), or None."""
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    return f"no {' and no '.join(missing)} on PATH to build its device memory" if missing else None


def build_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]
    return f"torchneuron_standin_{digest}"


def load(on_first_use: Callable[[str], None]) -> ctypes.CDLL:
    """Build (once per machine) and load the device; `on_first_use(why)` runs at the first allocation."""
    why = compiler_missing()
    if why is not None:
        raise RuntimeError(f"TorchNeuron stand-in: TORCHNEURON_STANDIN_DEVICE=1 but {why}")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # its CUDA_HOME notice is not ours
    from torch.utils import cpp_extension

    path = cpp_extension.load(build_name(), [str(SOURCE)], extra_cflags=FLAGS, is_python_module=False, with_cuda=False)
    library = ctypes.CDLL(path)
    hook = _HOOK(lambda reason: on_first_use(reason.decode()))
    library.neuron_standin_set_first_use(hook)
    _kept.extend([library, hook])
    return library


def set_device_count(library: ctypes.CDLL, count: int) -> None:
    library.neuron_standin_set_device_count(ctypes.c_int(count))
