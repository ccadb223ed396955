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


def _bert_head(model: torch.nn.Module, first_tokens: torch.Tensor) -> torch.Tensor:
    """BertForSequenceClassification's head on each document's first token: pooler (dense, tanh), dropout,
    classifier. The pooler reads position 0 of what it gets, so it gets one token per document."""
    pooled = model.bert.pooler(first_tokens[:, None, :])
    return model.classifier(model.dropout(pooled))


def _roberta_head(model: torch.nn.Module, first_tokens: torch.Tensor) -> torch.Tensor:
    """RobertaClassificationHead reads position 0 (dropout, dense, tanh, dropout, out_proj)."""
    return model.classifier(first_tokens[:, None, :])


def _distilbert_head(model: torch.nn.Module, first_tokens: torch.Tensor) -> torch.Tensor:
    """DistilBertForSequenceClassification's head: pre_classifier, ReLU, dropout, classifier."""
    pooled = torch.nn.functional.relu(model.pre_classifier(first_tokens))
    return model.classifier(model.dropout(pooled))


# model type -> its classification head from first-token states to logits, as its forward computes it. The
# encoder itself is the model's own forward (the module the backend compiled), its last hidden states read
# from `hidden_states`. A model type packs where its head is here and model/input_probe.py finds its
# per-document mask equivalent (tests/unit/test_packing_isolation.py proves it per family).
PACKED_HEADS: dict[str, Callable] = {"bert": _bert_head, "roberta": _roberta_head, "distilbert": _distilbert_head}


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


def packed_inputs(
    batch: dict, causal: bool, dtype: torch.dtype, use_cache: bool = False, position_offset: int = 0
) -> dict:
    """Keyword arguments for the model on a packed batch (the labels of a causal LM included; use_cache=False
    where `use_cache`; positions from `position_offset`, RoBERTa's pad_token_id + 1)."""
    positions = batch["position_ids"]
    inputs = {
        "input_ids": batch["input_ids"],
        "position_ids": positions + position_offset if position_offset else positions,
        "attention_mask": packed_attention_mask(batch["document_ids"], causal, dtype),
    }
    if causal:
        inputs["labels"] = batch["labels"]
    if use_cache:
        inputs["use_cache"] = False
    return inputs


def prepare_packed_classifier(model: torch.nn.Module, task: str, packing: Any) -> None:
    """Under packed sequence classification, install transformers' output-capturing hooks now, before a backend
    compiles the model: the packed path asks for `output_hidden_states`, and hooks installed on that first call
    (under a lock) make TorchDynamo break the graph and compile one more."""
    if packing is None or task != "sequence-classification" or not hasattr(model, "config"):
        return
    from transformers.utils.output_capturing import maybe_install_capturing_hooks  # lazy: a second to import

    maybe_install_capturing_hooks(model)


def packed_hidden_states(model: torch.nn.Module, batch: dict, dtype: torch.dtype, position_offset: int = 0) -> Any:
    """An encoder's last hidden states (rows, length, hidden) on a packed batch, through the model's own
    forward (its pooler and head run on each row's first token too, unread)."""
    inputs = packed_inputs(batch, causal=False, dtype=dtype, position_offset=position_offset)
    return model(**inputs, output_hidden_states=True).hidden_states[-1]


def packed_classification(model: torch.nn.Module, batch: dict, dtype: torch.dtype, position_offset: int = 0) -> Any:
    """Per-document logits (rows, max_docs, labels) and the mean cross-entropy over the real documents."""
    inner = getattr(model, "module", model)  # DDP's wrapper runs the forward; the head is the wrapped model's
    head = PACKED_HEADS[inner.config.model_type]
    hidden = packed_hidden_states(model, batch, dtype, position_offset)
    positions = batch["cls_positions"]
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
    first_tokens = hidden[rows, positions]  # (rows, max_docs, hidden)
    logits = head(inner, first_tokens.flatten(0, 1)).unflatten(0, positions.shape)
    labels = batch["labels"]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
    return SimpleNamespace(loss=loss, logits=logits)
