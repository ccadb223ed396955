"""`run --init-from DIR` under tensor parallel: each worker's starting shards.

From NxD shards at the run's own TP degree (what `checkpoint migrate --to neuron --tp N` writes, or a TP run's
checkpoint), each worker reads its own rank file, dp_rank_00_tp_rank_TT_pp_rank_00.pt, and splits its fused
tensors (qkv, gate_up) back into the model's; from shards of another degree, or from any checkpoint `migrate`
reads, the whole tensors are read and each worker keeps its piece, cut by `rules.shard` as migrate cuts it.
Either way a worker holds what migrate would have written for its rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from neurontrain.checkpoint.formats import read_piece
from neurontrain.checkpoint.initial import InitialCheckpoint, open_initial_weights
from neurontrain.checkpoint.nxd import NxdReader, is_nxd_checkpoint
from neurontrain.errors import UsageError
from neurontrain.logs import get_logger
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.strategies import Strategy
from neurontrain.loop.tp_workers import TensorParallelWorkers
from neurontrain.parallel.nxd_layout import rank_file, unfuse_rank
from neurontrain.parallel.rules import piece_of, rule_for
from neurontrain.parallel.tensor_parallel import model_spec

log = get_logger(__name__)


def initial_loaders(init: InitialCheckpoint, workers: DataParallel) -> dict[str, Callable]:
    """The Trainer's `initialize` and `initialize_optimizer` for `run --init-from`: whole tensors and AdamW
    state (native tensor parallel too: the model is sharded after they load), or under NxD's tensor parallel
    (`workers` a TensorParallelWorkers without a mesh) the worker's shards, with AdamW fresh."""
    if not isinstance(workers, TensorParallelWorkers) or workers.mesh is not None:  # native: sharded after
        return {"initialize": init.load_weights, "initialize_optimizer": init.load_optimizer}

    def weights(model: torch.nn.Module) -> None:
        load_initial_tp_weights(model, init.path, workers.tp, workers.tp_rank)

    def optimizer(strategy: Strategy, model: torch.nn.Module) -> None:
        if not init.weights_only and open_initial_weights(init.path, model).optimizer_state():
            raise UsageError(
                f"--init-from {init.path}: its AdamW state is not loaded under parallel.tp yet; pass "
                "--init-from-weights-only to start AdamW fresh"
            )

    return {"initialize": weights, "initialize_optimizer": optimizer}


def _rank_pieces(model: torch.nn.Module, path: Path, tp: int, tp_rank: int) -> tuple[dict[str, torch.Tensor], str]:
    spec = model_spec(model, tp)
    names = list(spec.names)
    if is_nxd_checkpoint(path):
        reader = NxdReader(path)
        if (reader.spec.tp, reader.spec.pp) == (tp, 1) and reader.spec.names == names:
            try:
                return unfuse_rank(spec, names, reader.rank_file_tensors(tp_rank, 0)), rank_file(tp_rank, 0)
            except KeyError as missing:
                raise UsageError(f"--init-from {path}: {rank_file(tp_rank, 0)} lacks {missing}") from None
        source = reader
    else:
        source = open_initial_weights(path, model)
    absent = [name for name in names if name not in source.keys()]
    if absent:
        raise UsageError(f"--init-from {path}: lacks {len(absent)} of the model's tensors (first: {absent[0]})")
    pieces = {
        name: read_piece(source, name, piece_of(spec, rule_for(spec, name), source.meta(name)[0], tp_rank))
        for name in names
    }
    return pieces, f"tp rank {tp_rank}'s slices of whole tensors ({source.description})"


def load_initial_tp_weights(model: torch.nn.Module, path: Path, tp: int, tp_rank: int) -> None:
    """Replace this worker's shards (on the host) with its pieces of the checkpoint at `path`; every parameter
    must be covered, with this rank's shapes. Values are cast to the model's dtypes."""
    pieces, origin = _rank_pieces(model, path, tp, tp_rank)
    params = dict(model.named_parameters())
    for name, piece in pieces.items():
        if tuple(piece.shape) != tuple(params[name].shape):
            raise UsageError(
                f"--init-from {path}: {name} is {list(piece.shape)} for tp rank {tp_rank} there and "
                f"{list(params[name].shape)} in the run's model (is it the same model config?)"
            )
    with torch.no_grad():
        for name, piece in pieces.items():
            params[name].copy_(piece)
    log.info(f"initial weights: {len(pieces)} tensors from {path} ({origin})")
