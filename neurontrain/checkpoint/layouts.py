"""Which tool wrote a checkpoint, and the reader for it.

| layout             | written by                                              | point migrate at            |
|--------------------|---------------------------------------------------------|-----------------------------|
| hf, hf-sharded     | save_pretrained (safetensors or .bin, with an index)    | the directory               |
| hf-trainer         | transformers Trainer (optimizer.pt beside the weights) | checkpoint-N/               |
| accelerate         | accelerate save_state (optimizer.bin beside)            | the save_state directory    |
| dcp                | torch.distributed.checkpoint (FSDP2, FSDP1 sharded)     | the directory (.metadata)   |
| lightning-sharded  | Lightning FSDP, state_dict_type="sharded" (meta.pt)     | last.ckpt/                  |
| lightning          | Lightning Trainer .ckpt file                            | the .ckpt file              |
| torch              | torch.save of a state dict or training dict (DDP, FSDP) | the file                    |
| safetensors        | safetensors save_file                                   | the file                    |
| deepspeed          | DeepSpeed ZeRO 1-3 (fp32 rebuilt by its zero_to_fp32)   | the dir with `latest`       |

DeepSpeed's optimizer partitions are read too (deepspeed_zero.py). Without deepspeed installed, a ZeRO directory
is refused in one line (run the zero_to_fp32.py DeepSpeed writes beside it and migrate the file it makes).
"""

from __future__ import annotations

import json
from pathlib import Path

from neurontrain.checkpoint.deepspeed_zero import ZeroSource, is_deepspeed, tagged_directory
from neurontrain.checkpoint.formats import (
    DCPSource,
    SafetensorsSource,
    TensorSource,
    TorchSource,
    load_torch_file,
)
from neurontrain.errors import UsageError

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _read_config(directory: Path) -> dict | None:
    path = directory / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            raise UsageError(f"{path} is not valid JSON") from None
    return None


def find_config(path: Path, config_path: Path | None) -> dict | None:
    """--config (a directory or a config.json), else a config.json beside the checkpoint."""
    if config_path is not None:
        if config_path.is_file():
            try:
                return json.loads(config_path.read_text())
            except json.JSONDecodeError:
                raise UsageError(f"{config_path} is not valid JSON") from None
        if config_path.is_dir():
            found = _read_config(config_path)
            if found is None:
                raise UsageError(f"--config {config_path}: no config.json there")
            return found
        raise UsageError(f"--config {config_path} does not exist")
    return _read_config(path if path.is_dir() else path.parent)


def _hf_weights(path: Path, config: dict | None, layout: str, writer: str) -> TensorSource | None:
    """The model weights save_pretrained (or accelerate, or the Trainer) leaves in a directory, if any."""
    index = next((path / name for name in _INDEXES if (path / name).is_file()), None)
    if index is not None:
        try:
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (json.JSONDecodeError, KeyError):
            raise UsageError(f"{index} is not a valid weight index") from None
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise UsageError(f"{index} names a missing shard {missing[0].name}")
        layout = "hf-sharded" if layout == "hf" else layout
        if index.name.startswith("model.safetensors"):
            return SafetensorsSource(files, config, f"{layout} {path}", layout, writer)
        return TorchSource(files, config, f"{layout} {path}", layout, writer)
    if (path / "model.safetensors").is_file():
        return SafetensorsSource([path / "model.safetensors"], config, f"{layout} {path}", layout, writer)
    if (path / "pytorch_model.bin").is_file():
        return TorchSource([path / "pytorch_model.bin"], config, f"{layout} {path}", layout, writer)
    return None


def _open_directory(path: Path, config: dict | None) -> TensorSource:
    if (path / ".metadata").is_file():
        if (path / "meta.pt").is_file():
            return DCPSource(path, config, "lightning-sharded", "Lightning (FSDP strategy, state_dict_type='sharded')")
        return DCPSource(path, config)
    if is_deepspeed(path):
        return ZeroSource(path, config or _read_config(tagged_directory(path)[0]))
    if (path / "trainer_state.json").is_file():
        source = _hf_weights(path, config, "hf-trainer", "transformers Trainer")
        optimizer = path / "optimizer.pt"
    elif any(path.glob("random_states_*.pkl")) or (path / "optimizer.bin").is_file():
        source = _hf_weights(path, config, "accelerate", "accelerate (Accelerator.save_state)")
        optimizer = path / "optimizer.bin"
    else:
        source = _hf_weights(path, config, "hf", "transformers save_pretrained")
        optimizer = path / "optimizer.pt"  # as `migrate --to gpu --with-optimizer` writes it
    if source is None:
        raise UsageError(f"{path}: no model.safetensors, pytorch_model.bin, weight index or DCP .metadata found")
    source.load_optimizer_file(optimizer)
    return source


def _open_file(path: Path, config: dict | None) -> TensorSource:
    if path.suffix == ".safetensors":
        return SafetensorsSource([path], config, f"safetensors {path}", "safetensors", "safetensors save_file")
    top = load_torch_file(path)
    if isinstance(top, dict) and ("pytorch-lightning_version" in top or "optimizer_states" in top):
        return TorchSource([path], config, f"lightning {path}", "lightning", "Lightning Trainer (.ckpt)", top)
    return TorchSource([path], config, f"torch {path}", "torch", "torch.save", top)


def open_gpu_checkpoint(path: Path, config_path: Path | None = None) -> TensorSource:
    """Any GPU-side checkpoint (see the table above), as tensors under the names found in it."""
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    config = find_config(path, config_path)
    return _open_directory(path, config) if path.is_dir() else _open_file(path, config)
