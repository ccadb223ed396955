"""The model side of packed rows: per-document attention masks and per-document classification.

A packed row holds several documents. Each token attends only to tokens of its own document (block-diagonal
for encoders, block-causal for decoders), built on the device from the row's document ids, and its position
restarts at every document. Padding tokens form one more block of their own, so no row of the mask is empty.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from neurontrain.data.collate import IGNORE_INDEX

# Model types whose isolation under packing is tested (tests/unit/test_packing_isolation.py): a decoder must
# take a ready 4D additive mask and position ids as they are.
PACKED_CAUSAL_LM = ("llama", "mistral", "qwen2")


def _bert_head(model: torch.nn.Module, first_tokens: torch.Tensor) -> torch.Tensor:
    """BertForSequenceClassification's head on each document's first token: pooler (dense, tanh), dropout,
    classifier. The pooler reads position 0 of what it gets, so it gets one token per document."""
    pooled = model.bert.pooler(first_tokens[:, None, :])
    return model.classifier(model.dropout(pooled))


def _bert_body(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    return model.bert(**inputs).last_hidden_state


# model type -> (encoder returning the last hidden states, head from first-token states to logits)
PACKED_CLASSIFIERS: dict[str, tuple[Callable, Callable]] = {"bert": (_bert_body, _bert_head)}


def unpackable_reason(task: str, model_type: str, num_labels: int) -> str | None:
    """Why packing cannot train this model here (its per-document attention or head is not wired and tested),
    or None."""
    if task == "causal-lm":
        if model_type not in PACKED_CAUSAL_LM:
            return f"{model_type} is not a model type packing supports for causal-lm ({', '.join(PACKED_CAUSAL_LM)})"
        return None
    if model_type not in PACKED_CLASSIFIERS:
        supported = ", ".join(PACKED_CLASSIFIERS)
        return f"{model_type} is not a model type packing supports for sequence-classification ({supported})"
    if num_labels < 2:
        return "sequence classification packs only with model.num_labels of 2 or more"
    return None


def packed_attention_mask(document_ids: torch.Tensor, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """(rows, 1, length, length) additive mask: 0 where query and key are in the same document (and, for a
    decoder, the key is not after the query), the dtype's minimum elsewhere."""
    same = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    if causal:
        length = document_ids.shape[1]
        positions = torch.arange(length, device=document_ids.device)
        same = same & (positions[None, None, None, :] <= positions[None, None, :, None])
    zero = torch.zeros((), dtype=dtype, device=document_ids.device)
    return torch.where(same, zero, torch.finfo(dtype).min)


def packed_inputs(batch: dict, causal: bool, dtype: torch.dtype) -> dict:
    """Keyword arguments for the model on a packed batch (the labels of a causal LM included)."""
    inputs = {
        "input_ids": batch["input_ids"],
        "position_ids": batch["position_ids"],
        "attention_mask": packed_attention_mask(batch["document_ids"], causal, dtype),
    }
    if causal:
        inputs["labels"] = batch["labels"]
    return inputs


def packed_classification(model: torch.nn.Module, batch: dict, dtype: torch.dtype) -> Any:
    """Per-document logits (rows, max_docs, labels) and the mean cross-entropy over the real documents."""
    body, head = PACKED_CLASSIFIERS[model.config.model_type]
    hidden = body(model, packed_inputs(batch, causal=False, dtype=dtype))
    positions = batch["cls_positions"]
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
    first_tokens = hidden[rows, positions]  # (rows, max_docs, hidden)
    logits = head(model, first_tokens.flatten(0, 1)).unflatten(0, positions.shape)
    labels = batch["labels"]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
    return SimpleNamespace(loss=loss, logits=logits)
