"""The tokenized data of a recipe: from the tokenized store when an earlier run (or another process) built it for
the same content, else tokenized now into the store (`data/store.py`) and memory-mapped from there.

Tokenizing runs chunk by chunk through the tokenizer's Rust batch encoder, which spreads each chunk over the host's
cores; a word-level tokenizer is trained on the first `WORD_LEVEL_SAMPLE` training documents and kept in the store
with the ids.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from neurontrain.data.overlong import OverlongCounts, fit_documents
from neurontrain.data.records import RecordSource, label_column, text_column
from neurontrain.data.store import SplitWriter, StoreEntry, open_or_build, token_dtype
from neurontrain.data.token_seqs import TokenSeqs
from neurontrain.data.tokenizers import build_tokenizer, encoder_for, load_tokenizer, save_tokenizer
from neurontrain.errors import UsageError
from neurontrain.recipe import Recipe

# A word-level vocabulary is the corpus's most frequent words: their ranking settles long before a few hundred
# thousand documents, and training on millions costs minutes for the same vocabulary.
WORD_LEVEL_SAMPLE = 100_000
_PROGRESS_FROM = 50_000  # documents: smaller data tokenizes in seconds, without a progress bar


@dataclass
class PreparedData:
    """The tokenized data. Where a data service makes the training batches (`data.service`), the training
    side holds a copy without the training ids (`without_train_ids`): what planning needs, the lengths."""

    tokenizer: Any
    pad_id: int
    train_ids: TokenSeqs | None  # None: the ids stay where the batches are made
    train_labels: list[int] | None
    eval_ids: TokenSeqs
    eval_labels: list[int] | None
    truncated: int
    known_train_lengths: list[int] | None = None  # set where train_ids is None
    store: dict = field(default_factory=dict)  # where the ids came from and what tokenizing them did

    @property
    def train_lengths(self) -> list[int]:
        if self.train_ids is None:
            return self.known_train_lengths or []
        return self.train_ids.lengths

    @property
    def train_samples(self) -> int:
        return len(self.train_lengths)

    def without_train_ids(self) -> PreparedData:
        return replace(self, train_ids=None, train_labels=None, known_train_lengths=list(self.train_lengths))

    def truncate_train(self, index: int, limit: int) -> None:
        """Cut training sample `index` to `limit` tokens (its length, where only lengths are held)."""
        if self.train_ids is not None:
            self.train_ids.truncate(index, limit)
        else:
            assert self.known_train_lengths is not None
            self.known_train_lengths[index] = min(self.known_train_lengths[index], limit)

    @property
    def eval_lengths(self) -> list[int]:
        return self.eval_ids.lengths


def _tokenizer_identity(recipe: Recipe, tokenizer: Any) -> dict:
    if tokenizer is None:  # trained on the data: the data's identity and these settings say what it is
        return {"word_level": recipe.tokenizer.word_level.model_dump(mode="json"), "sample": WORD_LEVEL_SAMPLE}
    text = tokenizer.backend_tokenizer.to_str() if tokenizer.is_fast else repr(sorted(tokenizer.get_vocab().items()))
    specials = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    return {"digest": hashlib.sha256(text.encode()).hexdigest(), "specials": specials}


def _material(recipe: Recipe, source: RecordSource, tokenizer: Any) -> dict:
    d = recipe.data
    return {
        "records": source.identity(),
        "task": recipe.task,
        "fields": [d.text_field, d.label_field if recipe.task == "sequence-classification" else None],
        "num_labels": recipe.model.num_labels if recipe.task == "sequence-classification" else None,
        "max_length": d.max_length,
        "overlong": d.overlong,
        "tokenizer": _tokenizer_identity(recipe, tokenizer),
    }


def _encoded(recipe: Recipe, source: RecordSource, encode: Callable) -> Iterator[tuple[str, dict, list]]:
    """(split, columns, ids) of each chunk: a thread encodes one chunk (the Rust encoder releases the GIL) while
    the next is read or generated."""
    with ThreadPoolExecutor(1) as pool:
        pending = None
        for split, columns in source.chunks():
            future = pool.submit(encode, text_column(columns, recipe))
            if pending is not None:
                yield pending[0], pending[1], pending[2].result()
            pending = (split, columns, future)
        if pending is not None:
            yield pending[0], pending[1], pending[2].result()


def _tokenize_into(recipe: Recipe, source: RecordSource, tokenizer: Any, directory: Path) -> dict:
    """Tokenize every record into the store's files under `directory`; what meta.json records of it."""
    from tqdm import tqdm  # lazy: only a build shows progress

    d = recipe.data
    if tokenizer is None:
        tokenizer = build_tokenizer(recipe, source.train_texts(WORD_LEVEL_SAMPLE))
        save_tokenizer(tokenizer, directory)
    dtype = token_dtype(len(tokenizer))
    writers = {split: SplitWriter(directory, split, dtype) for split in ("train", "eval")}
    counts = {split: OverlongCounts() for split in writers}
    total = source.count()
    interval = 0.5 if sys.stderr.isatty() else 30.0
    with tqdm(total=total, unit="doc", desc="tokenizing", disable=total < _PROGRESS_FROM, mininterval=interval) as bar:
        for split, columns, encoded in _encoded(recipe, source, encoder_for(tokenizer)):
            first = counts[split].documents
            samples, origin, made = fit_documents(encoded, d.max_length, d.overlong, split, first)
            labels = None
            if recipe.task == "sequence-classification":
                values = _labels(label_column(columns, recipe), recipe.model.num_labels, first)
                labels = [values[i] for i in origin]
            writers[split].append(samples, labels)
            counts[split].add(made)
            bar.update(made.documents)
    splits = {split: writer.finish() for split, writer in writers.items()}
    return {"splits": splits, "counts": {split: c.as_dict() for split, c in counts.items()}}


def prepare_data(recipe: Recipe) -> PreparedData:
    source = RecordSource(recipe)
    tokenizer = None if recipe.tokenizer.word_level is not None else build_tokenizer(recipe, iter(()))
    entry = open_or_build(
        _material(recipe, source, tokenizer), lambda directory: _tokenize_into(recipe, source, tokenizer, directory)
    )
    if tokenizer is None:
        tokenizer = load_tokenizer(recipe, entry.path)
    train, evals = entry.split("train"), entry.split("eval")
    if not len(train.ids):
        raise UsageError("the training data is empty")
    truncated = sum(c["truncated"] for c in entry.meta["counts"].values())
    return PreparedData(
        tokenizer,
        int(tokenizer.pad_token_id),
        train.ids,
        train.labels,
        evals.ids,
        evals.labels,
        truncated,
        store=_store_summary(entry),
    )


def _store_summary(entry: StoreEntry) -> dict:
    counts = entry.meta["counts"]
    return {
        "path": str(entry.path),
        "tokenized_documents": sum(c["documents"] for c in counts.values()) if entry.built else 0,
        "build_seconds": entry.meta.get("build_seconds") if entry.built else 0.0,
        "tokens_kept": sum(c["kept_tokens"] for c in counts.values()),
        "tokens_dropped": sum(c["dropped_tokens"] for c in counts.values()),
        "documents_split": sum(c["split"] for c in counts.values()),
        "documents_truncated": sum(c["truncated"] for c in counts.values()),
    }


def _labels(values: list, num_labels: int, first_index: int) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < num_labels:
            raise UsageError(
                f"label {v!r} of sample {first_index + i} is not an integer in [0, {num_labels}) (model.num_labels)"
            )
        out.append(v)
    return out
