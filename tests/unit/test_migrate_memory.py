"""The memory bound of `checkpoint migrate`, proved by structure rather than by timing (issue 14): what the
process reads from the source and what it holds at the moment it writes each output file.

- Bytes read: every read of the source safetensors goes through an intercepted `safe_open`; the bytes of
  each tensor read (whole or sliced) are summed. `--to neuron` must read exactly the ranks' pieces: for a
  split tensor, its bytes once over all ranks; a replicated one, once per rank.
- Bytes held at each write (a rank file for `--to neuron`, a tensor for `--to gpu`, whose safetensors files are
  written a tensor at a time): the live tensors of this process (gc), split by where their memory lies
  (/proc/self/maps): anonymous memory, which must stay within what is being written plus one tensor over
  what was live before the migrate, and pages of the checkpoint files mapped and resident in this process
  (/proc/self/smaps Rss), which must stay within the read budget of the mapped files plus one tensor.
The checkpoint is 8x bigger than a rank file, so holding the checkpoint (or all rank files) fails both.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import transformers

import neurontrain.checkpoint.formats as formats
import neurontrain.checkpoint.mapped as mapped
import neurontrain.checkpoint.migrate as migrate_module
import neurontrain.checkpoint.nxd as nxd_module
from neurontrain.checkpoint.migrate import MigrateOptions, migrate

TP = 8


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A Llama of 37 MB (fp32), GQA 8 query / 4 KV heads, no tied embeddings."""
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("memory") / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="20MB")
    return path


def _file_mappings() -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's file-backed mappings."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, parts[5]))
    return out


def anonymous_tensor_bytes() -> int:
    """Bytes of the storages of tensors outside every file mapping that are still in memory: no collection runs
    first, so tensors that only a reference cycle keeps (garbage not yet collected) count too."""
    files = _file_mappings()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            try:
                ptr = storage.data_ptr()
            except RuntimeError:  # a fake tensor that an earlier test's torch.compile left: it holds no memory
                continue
            if ptr and not any(start <= ptr < end for start, end, _ in files):
                seen[ptr] = storage.nbytes()
    return sum(seen.values())


def resident_bytes_of_files_under(directory: Path) -> int:
    """Resident bytes (smaps Rss) of this process's mappings of files under `directory`."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) == 6 and head[5].startswith(str(directory))
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


@pytest.fixture(autouse=True)
def _thaw_heap():
    yield
    gc.unfreeze()


class Watch:
    """Bytes held at each file write, against the bytes live before the migrate began. Every object alive before
    is frozen (gc.freeze: gc.get_objects no longer lists it), so each scan walks only what came after, not the whole
    test process's heap; a tensor alive before that the migrate frees no longer lowers the figure, which can only
    make the bound stricter."""

    def __init__(self, mapped_root: Path) -> None:
        gc.freeze()
        self.mapped_root, self.base = mapped_root, anonymous_tensor_bytes()
        self.writes: list[tuple[int, int, int]] = []  # (bytes written, anonymous bytes held, resident mapped)

    def at_write(self, tensors: dict) -> None:
        written = sum(t.numel() * t.element_size() for t in _tensors_in(tensors))
        held = anonymous_tensor_bytes() - self.base
        self.writes.append((written, held, resident_bytes_of_files_under(self.mapped_root)))


def _tensors_in(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v)]
    return []


def largest_tensor_bytes(directory: Path) -> int:
    source = migrate_module.open_checkpoint(directory)
    return max(torch.Size(source.meta(n)[0]).numel() * source.meta(n)[1].itemsize for n in source.keys())


class CountingHandle:
    """safe_open's handle, counting the bytes of every tensor it hands out."""

    def __init__(self, handle, reads: dict) -> None:
        self.handle, self.reads = handle, reads

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, key):
        tensor = self.handle.get_tensor(key)
        self.reads[key] = self.reads.get(key, 0) + tensor.numel() * tensor.element_size()
        return tensor

    def get_slice(self, key):
        return CountingSlice(self.handle.get_slice(key), key, self.reads)


class CountingSlice:
    def __init__(self, piece, key: str, reads: dict) -> None:
        self.piece, self.key, self.reads = piece, key, reads

    def get_shape(self):
        return self.piece.get_shape()

    def get_dtype(self):
        return self.piece.get_dtype()

    def __getitem__(self, index):
        tensor = self.piece[index]
        self.reads[self.key] = self.reads.get(self.key, 0) + tensor.numel() * tensor.element_size()
        return tensor


def test_to_neuron_reads_only_each_ranks_slices_and_holds_one_rank_file(hf_dir, tmp_path, monkeypatch):
    reads: dict[str, int] = {}
    real_open = formats.safe_open
    monkeypatch.setattr(formats, "safe_open", lambda *a, **k: CountingHandle(real_open(*a, **k), reads))
    watch = Watch(hf_dir)
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (watch.at_write(obj), real_save(obj, f, *a, **k)))

    migrate(hf_dir, tmp_path / "nxd", MigrateOptions(to="neuron", tp=TP))

    source = migrate_module.open_checkpoint(hf_dir)
    for name in source.keys():
        shape, dtype = source.meta(name)
        size = torch.Size(shape).numel() * dtype.itemsize
        # norms are replicated; with TP 8 over 4 KV heads each KV head goes to 2 ranks; everything else is split
        copies = TP if len(shape) == 1 else TP // 4 if name.endswith(("k_proj.weight", "v_proj.weight")) else 1
        expected = size * copies
        assert reads.get(name) == expected, (name, reads.get(name), expected)
    largest = largest_tensor_bytes(hf_dir)
    assert len(watch.writes) == TP
    checkpoint_bytes = sum(reads.values())
    for written, held, resident in watch.writes:
        assert written * TP < checkpoint_bytes * 1.1  # a rank file: an eighth of the model, and the norms
        assert held <= written + largest, (held, written, largest)
        assert resident <= largest, resident


def test_to_gpu_holds_one_tensor_and_a_bounded_window_of_rank_files(hf_dir, tmp_path, monkeypatch):
    nxd = tmp_path / "nxd"
    migrate(hf_dir, nxd, MigrateOptions(to="neuron", tp=TP))
    budget = 2 << 20
    monkeypatch.setattr(mapped, "READ_BUDGET_BYTES", budget)
    loads = []
    real_load = nxd_module.load_torch_file
    monkeypatch.setattr(nxd_module, "load_torch_file", lambda path: (loads.append(path), real_load(path))[1])
    watch = Watch(nxd)
    real_write = migrate_module.write_safetensors
    files = []

    def write_safetensors(path, metas, tensor, metadata=None):
        files.append(path)

        def watched(name):
            value = tensor(name)
            watch.at_write({name: value})
            return value

        real_write(path, metas, watched, metadata)

    monkeypatch.setattr(migrate_module, "write_safetensors", write_safetensors)
    migrate(nxd, tmp_path / "back", MigrateOptions(to="gpu", max_shard_bytes=8 << 20))

    largest = largest_tensor_bytes(hf_dir)
    checkpoint_bytes = sum(written for written, _, _ in watch.writes)
    assert len(files) >= 4 and len(loads) > TP  # several output files; rank files mapped again
    assert checkpoint_bytes > 3 * largest
    for written, held, resident in watch.writes:
        assert held <= written + largest, (held, written, largest)  # the tensor written, and one being built
        assert resident <= budget + largest, (resident, budget, largest)
