"""Opening any supported checkpoint: the toolkit's own, NxD's and optimum-neuron's shards (names known), and every
GPU layout (layouts.py), whose names are matched against the model of the config (matching.py)."""

from __future__ import annotations

from pathlib import Path

from neurontrain.checkpoint.formats import TensorSource
from neurontrain.checkpoint.layouts import open_gpu_checkpoint
from neurontrain.checkpoint.matching import MappedSource
from neurontrain.checkpoint.nxd import NxdReader, incomplete_tags, is_nxd_checkpoint
from neurontrain.checkpoint.optimum_neuron import OptimumNeuronReader, shards_of
from neurontrain.errors import UsageError
from neurontrain.loop.checkpoints import latest_checkpoint


def _toolkit_config(checkpoint_dir: Path) -> Path | None:
    for candidate in (checkpoint_dir.parent.parent / "model", checkpoint_dir / "model"):
        if (candidate / "config.json").is_file():
            return candidate
    return None


def open_checkpoint(path: Path, config: Path | None = None) -> TensorSource:
    """Any supported checkpoint, as tensors under the names found in it (NxD shards: Hugging Face names)."""
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    shards = shards_of(path) if path.is_dir() else None
    if shards is not None:
        return OptimumNeuronReader(shards)
    if is_nxd_checkpoint(path):
        return NxdReader(path)
    unfinished = incomplete_tags(path)
    if unfinished:
        raise UsageError(f"{path}: NxD checkpoint tag {unfinished[-1]} has no `done` marker (its save did not finish)")
    if path.is_dir() and (path / "state.pt").is_file():  # a toolkit training checkpoint
        source = open_gpu_checkpoint(path / "state.pt", config or _toolkit_config(path))
    elif path.is_dir() and (path / "checkpoints").is_dir():  # a run's output directory: its newest checkpoint
        latest = latest_checkpoint(path / "checkpoints")
        if latest is None:
            raise UsageError(f"{path}/checkpoints holds no complete checkpoint")
        source = open_gpu_checkpoint(latest / "state.pt", config or _toolkit_config(latest))
    else:
        return open_gpu_checkpoint(path, config)
    source.layout, source.writer = "neurontrain", "neurontrain run (training checkpoint)"
    return source


def open_model_checkpoint(path: Path, config: Path | None = None, required: bool = True) -> TensorSource:
    """The checkpoint under the model's own names: NxD shards as they are, any other layout through the one
    mapping of its names that covers the model of its config. Without a config: a UsageError when required,
    else the names found."""
    source = open_checkpoint(path, config)
    if isinstance(source, (NxdReader, OptimumNeuronReader)):
        return source
    if source.config is None:
        if not required:
            return source
        raise UsageError(
            f"{source.description}: no model config.json found beside the checkpoint, and its names are matched "
            "against the model: pass --config with the Hugging Face config (a directory or a config.json)"
        )
    return MappedSource(source, source.config)
