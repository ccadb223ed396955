"""Static shapes for Lightning batches: each batch padded on the host to the plan's bucket before it moves to the
device, and `buckets="auto"` chosen from the train loader's batch lengths with the toolkit's cost model.

The contract (docs/lightning.md): padding must be neutral under the user's loss. Tokens are padded with
the pad token id (0 unless given), attention masks with 0 (the model ignores the position), labels with -100
(the ignore index of `torch.nn.functional.cross_entropy`), so a loss that averages over non-ignored labels is
unchanged. A loss that averages over every position, or ignores no label, is not.

torch only (no Lightning, no torch-xla): unit-tested in process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from neurontrain.data.buckets import bucket_for, choose_buckets, default_cost_model, round_up
from neurontrain.errors import UsageError

IGNORE_INDEX = -100
DEFAULT_PAD_VALUES = {"input_ids": 0, "attention_mask": 0, "token_type_ids": 0, "labels": IGNORE_INDEX}


@dataclass
class Padding:
    """How batches are padded: sequence buckets (ascending), pad values per key, and optionally the row count
    (a partial last batch padded with neutral rows, so it shares its bucket's graph)."""

    buckets: list[int]
    pad_values: dict[str, int | float] = field(default_factory=lambda: dict(DEFAULT_PAD_VALUES))
    rows: int | None = None

    def value(self, key: str) -> int | float:
        return self.pad_values.get(key, 0)


def sequence_length(batch: Mapping[str, Any]) -> int | None:
    """The batch's sequence length: dimension 1 of `input_ids`, else of its first tensor of two or more
    dimensions; None when it has none."""
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        return int(ids.shape[1])
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    return None


def batch_rows(batch: Mapping[str, Any]) -> int | None:
    """Rows of a dict batch: dimension 0 of its first tensor of one or more dimensions; None when it has none."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return int(value.shape[0])
    return None


def target_length(length: int, buckets: Sequence[int]) -> int:
    """The bucket a batch of `length` pads to; a batch longer than every bucket keeps its length (the guard
    names it as a shape the plan does not have)."""
    try:
        return bucket_for(length, buckets)
    except ValueError:
        return length


def pad_batch(batch: Any, padding: Padding) -> Any:
    """A dict batch with every tensor whose dimension 1 is the sequence length padded to its bucket (each key
    with its pad value), and rows added up to `padding.rows`; anything that is not a mapping is returned as it
    is. Host tensors in, host tensors out."""
    if not isinstance(batch, Mapping):
        return batch
    length = sequence_length(batch)
    target = target_length(length, padding.buckets) if length is not None else None
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = value
            continue
        fill = padding.value(key)
        if target is not None and value.dim() >= 2 and value.shape[1] == length and target > length:
            extra = torch.full((value.shape[0], target - length, *value.shape[2:]), fill, dtype=value.dtype)
            value = torch.cat([value, extra], dim=1)
        if padding.rows is not None and value.shape[0] < padding.rows:
            extra = torch.full((padding.rows - value.shape[0], *value.shape[1:]), fill, dtype=value.dtype)
            value = torch.cat([value, extra], dim=0)
        out[key] = value
    return type(batch)(out) if type(batch) is not dict and _rebuildable(batch) else out


def _rebuildable(batch: Mapping) -> bool:
    try:
        type(batch)({})
        return True
    except Exception:  # a mapping type that cannot be built from a dict: hand back a dict
        return False


def check_buckets(buckets: Sequence[int]) -> list[int]:
    """An explicit bucket list: positive lengths, returned ascending without repeats."""
    if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
        raise UsageError(f"buckets: give 'auto' or a list of positive lengths, not {list(buckets)!r}")
    return sorted(set(buckets))


def auto_buckets(
    batch_lengths: Sequence[int],
    *,
    batch_size: int,
    n_params: int,
    planned_batches: int,
    graphs_per_bucket: int,
    backend: str = "xla-cpu",
    max_buckets: int = 6,
    multiple: int = 8,
) -> list[int]:
    """Buckets from one pass over the train loader's batch lengths through `choose_buckets`' cost model (compile
    seconds per graph against padded step time). A batch's length is its longest sample's under dynamic
    padding, so each batch counts as one sample of that length."""
    if not batch_lengths:
        raise UsageError("buckets='auto': the train loader gave no batches with a sequence dimension")
    cost = default_cost_model(backend, n_params=n_params, n_layers=0, hidden=0, batch_size=batch_size)
    longest = round_up(max(batch_lengths), multiple)
    choice = choose_buckets(
        list(batch_lengths),
        planned_batches=max(1, planned_batches),
        graphs_per_bucket=graphs_per_bucket,
        cost=cost,
        max_buckets=max_buckets,
        multiple=multiple,
        max_length=longest,
    )
    return list(choice.buckets)


def resize_batch(batch: Any, target: int, padding: Padding) -> Any:
    """A dict batch brought to sequence length `target` whatever its own: cut when longer, padded as `pad_batch`
    pads when shorter (rows too). For a precompile fit, which must visit every bucket with the batches it gets:
    the shapes are what matter there, not the values."""
    if not isinstance(batch, Mapping):
        return batch
    length = sequence_length(batch)
    if length is None:
        return batch
    cut = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length and target < length:
            value = value[:, :target]
        cut[key] = value
    return pad_batch(cut, Padding([target], padding.pad_values, padding.rows))
