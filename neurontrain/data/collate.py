"""Turn a planned batch into fixed-shape tensors: padding, attention masks, ignored labels."""

from __future__ import annotations

from typing import Sequence

import torch

from neurontrain.data.plan import PlannedBatch

IGNORE_INDEX = -100


class Collator:
    """Builds `{input_ids, attention_mask, labels}` of shape (batch_size, batch.length).

    Rows beyond the planned samples (a padded last batch) are all padding with ignored labels, so the
    batch shape never changes. `real_tokens` (a host int, not sent to the device) counts non-pad tokens.
    """

    def __init__(self, token_ids: Sequence[Sequence[int]], labels: Sequence[int] | None, task: str,
                 batch_size: int, pad_id: int) -> None:
        self.token_ids = token_ids
        self.labels = labels
        self.task = task
        self.batch_size = batch_size
        self.pad_id = pad_id

    def __call__(self, batch: PlannedBatch) -> dict:
        rows, length = self.batch_size, batch.length
        input_ids = torch.full((rows, length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, length), dtype=torch.long)
        real = 0
        for row, index in enumerate(batch.indices):
            ids = self.token_ids[index][:length]
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
            real += len(ids)
        if self.task == "causal-lm":
            labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        else:
            labels = torch.full((rows,), IGNORE_INDEX, dtype=torch.long)
            for row, index in enumerate(batch.indices):
                labels[row] = int(self.labels[index])
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "real_tokens": real}
