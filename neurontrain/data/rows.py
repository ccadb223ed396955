"""A collated micro-batch as a Ray Data row and back: numpy columns with the row as the leading dimension."""

from __future__ import annotations

import numpy as np

HOST_INTS = ("real_tokens", "loss_items")  # collated values that stay host ints
_ROW_KEYS = ("position", "length", "produced_on")


def encode_row(position: int, batch: dict, produced_on: str) -> dict[str, np.ndarray]:
    """One collated micro-batch as a one-row batch of columns (the leading dimension is the row)."""
    row: dict[str, np.ndarray] = {
        "position": np.array([position], dtype=np.int64),
        "length": np.array([batch["input_ids"].shape[1]], dtype=np.int64),
        "produced_on": np.array([produced_on]),
    }
    for key, value in batch.items():
        row[key] = np.array([value], dtype=np.int64) if key in HOST_INTS else np.asarray(value)[None]
    return row


def decode_row(row: dict) -> tuple[int, str, dict]:
    """(position, node that made it, the micro-batch as the collator gave it) from a one-row batch."""
    import torch  # lazy: the training side's; the collation actors that encode rows need no torch

    batch: dict = {}
    for key, value in row.items():
        if key in _ROW_KEYS:
            continue
        # a copy: the arrays Ray hands over are read-only
        batch[key] = int(value[0]) if key in HOST_INTS else torch.from_numpy(np.array(value[0]))
    return int(row["position"][0]), str(row["produced_on"][0]), batch
