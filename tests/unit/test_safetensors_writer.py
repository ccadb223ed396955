"""Safetensors files written a tensor at a time, read back by safetensors itself."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from neurontrain.checkpoint.safetensors_writer import DTYPE_NAMES, write_safetensors


def test_every_dtype_shape_and_the_metadata_read_back_by_safetensors(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "bf16.matrix": torch.randn(7, 5).to(torch.bfloat16),
        "f32.vector": torch.randn(3),
        "f64.scalar": torch.tensor(2.5, dtype=torch.float64),
        "i64.steps": torch.arange(5),
        "u8.odd": torch.arange(3, dtype=torch.uint8),  # 3 bytes: the next tensor would be misaligned after it
        "bool.mask": torch.tensor([True, False, True]),
        "f16.empty": torch.empty(0, 4, dtype=torch.float16),
        "i8.cube": torch.arange(-4, 4, dtype=torch.int8).reshape(2, 2, 2),
    }
    asked = []

    def tensor(name):
        asked.append(name)
        return tensors[name]

    metas = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    write_safetensors(tmp_path / "m.safetensors", metas, tensor, {"format": "pt"})
    back = load_file(tmp_path / "m.safetensors")
    assert back.keys() == tensors.keys() and sorted(asked) == sorted(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    itemsizes = [tensors[name].element_size() for name in asked]
    assert itemsizes == sorted(itemsizes, reverse=True)  # widest first: every tensor starts aligned
    assert set(DTYPE_NAMES) >= {t.dtype for t in tensors.values()}


def test_a_tensor_that_differs_from_its_header_entry_is_refused(tmp_path):
    metas = {"a": ((2, 2), torch.float32)}
    with pytest.raises(ValueError, match="header says"):
        write_safetensors(tmp_path / "m.safetensors", metas, lambda name: torch.zeros(2, 3))
