"""The fit's buckets: an explicit list, or `auto` from one pass over the train loader's batch lengths through the
toolkit's cost model (`data/buckets.py`); and the rows every batch is padded to (the loader's batch size)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from neurontrain.errors import UsageError
from neurontrain.lightning.internals import train_dataloader
from neurontrain.lightning.padding import auto_buckets, check_buckets, sequence_length
from neurontrain.lightning.session import Options


def loader_lengths(loader: Any) -> tuple[list[int], int | None]:
    """(sequence length of each batch, largest batch size) from one pass over a loader of dict batches."""
    lengths, rows = [], None
    for batch in loader:
        if not hasattr(batch, "keys"):
            continue
        length = sequence_length(batch)
        if length is None:
            continue
        lengths.append(length)
        first = next(v for v in batch.values() if hasattr(v, "dim") and v.dim() >= 2)
        rows = max(rows or 0, int(first.shape[0]))
    return lengths, rows


def _generators(loader: Any) -> list[torch.Generator]:
    found = []
    for owner in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        for obj in (owner, getattr(owner, "sampler", None)):
            gen = getattr(obj, "generator", None)
            if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
                found.append(gen)
    return found


def lengths_keeping_order(loader: Any) -> tuple[list[int], int | None]:
    """`loader_lengths` with every random state the pass draws from put back afterwards (the loader's own
    generators, torch's, Python's and NumPy's global ones): the fit then sees the data order it would have
    seen without the pass."""
    generators = [(g, g.get_state()) for g in _generators(loader)]
    torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        return loader_lengths(loader)
    finally:
        for gen, state in generators:
            gen.set_state(state)
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def planned_batches(trainer: Any, per_epoch: int) -> int:
    """Micro-batches the fit will train: max_steps x accumulation, else max_epochs x the loader's length."""
    accumulate = trainer.accumulate_grad_batches
    if trainer.max_steps and trainer.max_steps > 0:
        return trainer.max_steps * accumulate
    return max(1, (trainer.max_epochs or 1) * per_epoch)


def choose_plan(trainer: Any, options: Options, module: Any, backend: str) -> tuple[list[int], str, int | None]:
    """(buckets, bucket mode, rows per batch); backend: the toolkit's backend name (its cost figures)."""
    loader = train_dataloader(trainer)
    batch_size = getattr(loader, "batch_size", None)
    if options.buckets != "auto":
        if isinstance(options.buckets, str):
            raise UsageError(f"buckets: give 'auto' or a list of lengths, not {options.buckets!r}")
        return check_buckets(list(options.buckets)), "fixed", batch_size
    lengths, rows = lengths_keeping_order(loader)
    n_params = sum(p.numel() for p in module.parameters())
    graphs = 1 + (1 if trainer.accumulate_grad_batches > 1 else 0) + (1 if trainer.limit_val_batches != 0 else 0)
    buckets = auto_buckets(
        lengths,
        batch_size=batch_size or rows or 1,
        n_params=n_params,
        planned_batches=planned_batches(trainer, len(lengths)),
        graphs_per_bucket=graphs,
        backend=backend,
        max_buckets=options.max_buckets,
        multiple=options.pad_to_multiple_of,
    )
    return buckets, "auto", batch_size or rows


def eval_loader_rows(trainer: Any, dataloader_idx: int = 0) -> int | None:
    """The batch size of the eval loader a batch comes from (validation, test or predict: Lightning's public
    `*_dataloaders`), None when it has none (a batch sampler)."""
    if trainer.testing:
        loaders = trainer.test_dataloaders
    elif trainer.predicting:
        loaders = trainer.predict_dataloaders
    else:
        loaders = trainer.val_dataloaders
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[dataloader_idx] if 0 <= dataloader_idx < len(loaders) else None
    rows = getattr(loaders, "batch_size", None)
    return rows if isinstance(rows, int) else None
