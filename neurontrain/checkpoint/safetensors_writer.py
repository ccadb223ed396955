"""Safetensors files written one tensor at a time.

The format, as the safetensors project specifies it: an 8-byte little-endian header length N, then N bytes of
JSON ({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, padded with spaces to
a multiple of 8), then the tensors' bytes in header order. The header needs only names, dtypes and shapes, so a
file is written as its tensors arrive: one tensor in memory rather than the whole file, in 1 MiB writes.
(safetensors' own `save_file` takes all of a file's tensors at once and hands each to the kernel in one write,
which ran at 0.4 GB/s where 1 MiB writes ran at 3.6 GB/s.) Tensors go in order of decreasing element size, as
safetensors orders them, so every tensor's bytes start aligned to its element size. What migrate writes this way
is opened again by safetensors itself before the destination is published.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from neurontrain.checkpoint.mapped import PiecewiseWriter, nbytes

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def layout(metas: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[str], dict[str, dict]]:
    """(the order the tensors are written in, the header's entry of each)."""
    order = sorted(metas, key=lambda name: (-metas[name][1].itemsize, name))
    header: dict[str, dict] = {}
    offset = 0
    for name in order:
        shape, dtype = metas[name]
        end = offset + math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    return order, header


def header_bytes(header: dict, metadata: dict[str, str] | None) -> bytes:
    if metadata:
        header = {"__metadata__": metadata, **header}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(
    path: Path,
    metas: dict[str, tuple[tuple[int, ...], torch.dtype]],
    tensor: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write the tensors named in `metas` (shape and dtype each) to `path`, asking `tensor(name)` for each in turn
    and letting it go once written. A tensor whose shape or dtype differs from its entry is a ValueError."""
    order, header = layout(metas)
    with open(path, "wb") as file:
        writer = PiecewiseWriter(file)
        writer.write(header_bytes(header, metadata))
        for name in order:
            value = tensor(name).contiguous()
            if (tuple(value.shape), value.dtype) != (tuple(metas[name][0]), metas[name][1]):
                raise ValueError(f"{name}: {tuple(value.shape)} {value.dtype}, the header says {metas[name]}")
            if nbytes(value):
                writer.write(value.view(-1).view(torch.uint8).numpy())
            del value
