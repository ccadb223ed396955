"""`run --init-from DIR`: a run's starting weights from a checkpoint instead of the model's own initialization.

NxD tensor-parallel shards (what `checkpoint migrate --to neuron` writes) are reassembled into whole tensors on
the way in, as `migrate --to gpu` does, so a data-parallel or ZeRO-1 run starts from exactly the weights the
shards were made from. Any other checkpoint `migrate` reads (Hugging Face, DCP, torch, Lightning, ...) is
matched against the run's own model by names and shapes. The weights load into the model on the host, before
it moves to the device.

When the checkpoint holds AdamW state (`migrate --with-optimizer` writes it beside the shards; training
checkpoints hold it), the run's optimizer starts from its moments and step counts too: the whole state for
replicated AdamW, each worker's chunks for ZeRO-1 (the strategy cuts them, `parallel/zero1_state.py`). The
learning rate, its schedule and the other hyper-parameters come from the recipe, never from the checkpoint;
the run counts its own steps from 1. `--init-from-weights-only` leaves the moments out.
"""

from __future__ import annotations

from pathlib import Path

import torch

from neurontrain.checkpoint.formats import TensorSource
from neurontrain.checkpoint.matching import MappedSource
from neurontrain.checkpoint.nxd import NxdReader, is_nxd_checkpoint
from neurontrain.checkpoint.opening import open_checkpoint
from neurontrain.errors import UsageError
from neurontrain.logs import get_logger
from neurontrain.loop.strategies import Strategy
from neurontrain.parallel.zero1_state import numbered_state

log = get_logger(__name__)


def open_initial_weights(path: Path, model: torch.nn.Module) -> TensorSource:
    """The checkpoint at `path` under `model`'s parameter names."""
    if is_nxd_checkpoint(path):
        return NxdReader(path)
    config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    source = open_checkpoint(path)
    try:
        return MappedSource(source, config)
    except UsageError:
        raise UsageError(
            f"--init-from {path}: its tensors do not fit the recipe's model (no renaming of its {len(source.keys())} "
            f"tensors gives the {type(model).__name__}'s names and shapes)"
        ) from None


def _check_shapes(source: TensorSource, expected: dict[str, torch.Tensor], path: Path) -> None:
    unknown = [name for name in source.keys() if name not in expected]
    if unknown:
        raise UsageError(f"--init-from {path}: {len(unknown)} tensors the model does not have (first: {unknown[0]})")
    for name in source.keys():
        shape = tuple(source.meta(name)[0])
        if shape != tuple(expected[name].shape):
            raise UsageError(
                f"--init-from {path}: {name} is {list(shape)} there and {list(expected[name].shape)} in the "
                "recipe's model (is it the same model config?)"
            )


def _untied_missing(model_state: dict[str, torch.Tensor], loaded: set[str]) -> list[str]:
    """Names the checkpoint lacks that no loaded tensor fills through weight tying (same storage)."""
    filled = {model_state[name].untyped_storage().data_ptr() for name in loaded}
    return [n for n, t in model_state.items() if n not in loaded and t.untyped_storage().data_ptr() not in filled]


def load_initial_weights(model: torch.nn.Module, path: Path) -> TensorSource:
    """Replace `model`'s weights (on the host) with the checkpoint's; every parameter must be covered, with the
    model's shapes. Values are cast to the model's dtypes as `from_pretrained` does. Returns the source."""
    source = open_initial_weights(path, model)
    expected = model.state_dict()
    _check_shapes(source, expected, path)
    missing = _untied_missing(expected, set(source.keys()))
    if missing:
        raise UsageError(f"--init-from {path}: lacks {len(missing)} of the model's tensors (first: {missing[0]})")
    with torch.no_grad():
        for name in source.keys():
            expected[name].copy_(source.get(name))
    log.info(f"initial weights: {len(source.keys())} tensors from {path} ({source.description})")
    return source


class InitialCheckpoint:
    """`run --init-from DIR`: the starting weights, then the starting optimizer state (unless weights_only)."""

    def __init__(self, path: Path, *, weights_only: bool = False) -> None:
        self.path, self.weights_only = path, weights_only
        self._source: TensorSource | None = None

    def load_weights(self, model: torch.nn.Module) -> None:
        self._source = load_initial_weights(model, self.path)

    def load_optimizer(self, strategy: Strategy, model: torch.nn.Module) -> None:
        """AdamW's moments and step counts from the checkpoint into the strategy's optimizer (after
        `load_weights`), or an info line saying AdamW starts fresh."""
        if self.weights_only:
            log.info("initial optimizer state: none taken (--init-from-weights-only): AdamW starts fresh")
            return
        source = self._source or open_initial_weights(self.path, model)
        moments = source.optimizer_state()
        if not moments:
            log.info(f"initial optimizer state: {self.path} holds none: AdamW starts fresh")
            return
        params = strategy.optimizer_parameters()
        names = {id(p): name for name, p in model.named_parameters()}
        try:
            plain = numbered_state(
                moments,
                [names[id(p)] for p in params],
                [p.shape for p in params],
                strategy.optimizer.state_dict()["param_groups"],
            )
        except ValueError as exc:
            raise UsageError(f"--init-from {self.path}: {exc} (--init-from-weights-only starts AdamW fresh)") from None
        strategy.load(plain, None, None)
        steps = sorted({int(s["step"]) for s in plain["state"].values()})
        log.info(
            f"initial optimizer state: AdamW moments of {len(params)} parameters from {self.path} (step count "
            f"{'/'.join(map(str, steps))}); learning rate and schedule from the recipe"
        )
