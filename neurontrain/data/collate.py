"""Turn a planned batch into fixed-shape tensors: padding, attention masks, ignored labels; for packed rows,
each token's document and position. Built as numpy arrays (`Collator.arrays`): the data service's collation
actors need no torch, whose import costs seconds in every actor."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from neurontrain.data.batching import IndexBatch
from neurontrain.data.packing import document_spans
from neurontrain.data.sharding import worker_rows

IGNORE_INDEX = -100


class Collator:
    """Builds `{input_ids, attention_mask, labels}` of shape (batch_size, batch.length).

    With several workers the planned batch is the global one and worker `rank` takes its rows
    (`worker_rows`). Rows beyond the planned samples (a padded last batch) are all padding with ignored labels,
    so the batch shape never changes. Host ints, not sent to the device: `real_tokens` counts non-pad tokens,
    `loss_items` the labels the loss averages over (the weight of this batch in a data-parallel reduction).

    Packed batches (`batch.rows`) give `{input_ids, document_ids, position_ids, labels}` instead: document ids
    1, 2, ... per row (0: padding), positions restarting at 0 in every document. Causal LM labels ignore each
    document's first token, so no prediction crosses a boundary. Sequence classification labels are
    (batch_size, max_docs), one per document slot, with `cls_positions` the slot's first token (ignored label
    and position 0 for an empty slot).

    With `loss_masks` (SFT data: the loss on completions or assistant turns) a causal-LM label is also -100 where
    the sample's mask is 0, packed or not; `loss_items` counts the labels left.
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
        max_docs: int | None = None,
        loss_masks: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.max_docs = max_docs
        self.loss_masks = loss_masks  # SFT: 1 where a token is trained on; its label is -100 elsewhere
        self.token_ids = token_ids
        self.labels = labels
        self.task = task
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.rank, self.world = rank, world

    def __call__(self, batch: IndexBatch) -> dict:
        """The batch as torch tensors (sharing the arrays' memory) and host ints."""
        import torch  # lazy: `arrays` alone needs no torch

        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in self.arrays(batch).items()}

    def arrays(self, batch: IndexBatch) -> dict:
        """The batch as int64 numpy arrays and host ints."""
        if batch.rows is not None:
            return self._packed(batch)
        rows, length = self.batch_size, batch.length
        indices = worker_rows(batch.indices, self.rank, self.world) if self.world > 1 else batch.indices
        input_ids = np.full((rows, length), self.pad_id, dtype=np.int64)
        attention_mask = np.zeros((rows, length), dtype=np.int64)
        trained = np.zeros((rows, length), dtype=np.int64)
        real = items = 0
        for row, index in enumerate(indices):
            ids = self.token_ids[index][:length]
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
            trained[row, : len(ids)] = 1 if self.loss_masks is None else self.loss_masks[index][: len(ids)]
            real += len(ids)
            # causal LM: next-token labels, the first token predicted by nothing
            items += int(trained[row, 1 : len(ids)].sum()) if self.task == "causal-lm" else 1
        if self.task == "causal-lm":
            labels = np.where(trained == 0, IGNORE_INDEX, input_ids)
        else:
            labels = np.full((rows,), IGNORE_INDEX, dtype=np.int64)
            for row, index in enumerate(indices):
                labels[row] = int(self.labels[index])
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "real_tokens": real,
            "loss_items": items,
        }

    def _packed(self, batch: IndexBatch) -> dict:
        rows = worker_rows(batch.rows, self.rank, self.world) if self.world > 1 else batch.rows
        shape = (self.batch_size, batch.length)
        input_ids = np.full(shape, self.pad_id, dtype=np.int64)
        document_ids = np.zeros(shape, dtype=np.int64)
        position_ids = np.zeros(shape, dtype=np.int64)
        causal = self.task == "causal-lm"
        if causal:
            labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        else:
            if self.max_docs is None:
                raise ValueError("packed sequence classification needs max_docs")
            labels = np.full((self.batch_size, self.max_docs), IGNORE_INDEX, dtype=np.int64)
            cls_positions = np.zeros((self.batch_size, self.max_docs), dtype=np.int64)
        real = items = 0
        for row, docs in enumerate(rows):
            if not causal and len(docs) > self.max_docs:
                raise ValueError(f"a packed row holds {len(docs)} documents, more than max_docs {self.max_docs}")
            spans = document_spans([len(self.token_ids[i]) for i in docs], batch.length)
            for number, (index, (start, n)) in enumerate(zip(docs, spans, strict=True), start=1):
                ids = np.asarray(self.token_ids[index][:n], dtype=np.int64)
                input_ids[row, start : start + n] = ids
                document_ids[row, start : start + n] = number
                position_ids[row, start : start + n] = np.arange(n)
                real += n
                if causal:
                    targets = ids[1:]
                    if self.loss_masks is not None:
                        targets = np.where(np.asarray(self.loss_masks[index][1:n]) == 0, IGNORE_INDEX, targets)
                    labels[row, start + 1 : start + n] = targets
                    items += int((targets != IGNORE_INDEX).sum())
                else:
                    labels[row, number - 1] = int(self.labels[index])
                    cls_positions[row, number - 1] = start
                    items += 1
        out = {"input_ids": input_ids, "document_ids": document_ids, "position_ids": position_ids, "labels": labels}
        if not causal:
            out["cls_positions"] = cls_positions
        return out | {"real_tokens": real, "loss_items": items}
