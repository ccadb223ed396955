"""Turn a planned batch into fixed-shape tensors: padding, attention masks, ignored labels."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neurontrain.data.batching import IndexBatch
from neurontrain.data.sharding import worker_rows

IGNORE_INDEX = -100


class Collator:
    """Builds `{input_ids, attention_mask, labels}` of shape (batch_size, batch.length).

    With several workers the planned batch is the global one and worker `rank` takes its rows
    (`worker_rows`). Rows beyond the planned samples (a padded last batch) are all padding with ignored labels,
    so the batch shape never changes. Host ints, not sent to the device: `real_tokens` counts non-pad tokens,
    `loss_items` the labels the loss averages over (the weight of this batch in a data-parallel reduction).
    """

    def __init__(
        self,
        token_ids: Sequence[Sequence[int]],
        labels: Sequence[int] | None,
        task: str,
        batch_size: int,
        pad_id: int,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.token_ids = token_ids
        self.labels = labels
        self.task = task
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.rank, self.world = rank, world

    def __call__(self, batch: IndexBatch) -> dict:
        rows, length = self.batch_size, batch.length
        indices = worker_rows(batch.indices, self.rank, self.world) if self.world > 1 else batch.indices
        input_ids = torch.full((rows, length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, length), dtype=torch.long)
        real = items = 0
        for row, index in enumerate(indices):
            ids = self.token_ids[index][:length]
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
            real += len(ids)
            items += max(len(ids) - 1, 0) if self.task == "causal-lm" else 1  # causal LM: next-token labels
        if self.task == "causal-lm":
            labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        else:
            labels = torch.full((rows,), IGNORE_INDEX, dtype=torch.long)
            for row, index in enumerate(indices):
                labels[row] = int(self.labels[index])
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "real_tokens": real,
            "loss_items": items,
        }
