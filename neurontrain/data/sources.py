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

from neurontrain.data.overlong import OverlongCounts, fit_documents, fit_masked
from neurontrain.data.records import RecordSource, label_column, text_column
from neurontrain.data.sft import SFTFormat, detect_format, encoder_for_format, resolve, template_markers, template_text
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
    # SFT data: each sample's loss mask (1: trained on), over the ids' own starts and lengths; None: all tokens
    train_masks: TokenSeqs | None = None
    eval_masks: TokenSeqs | None = None

    @property
    def train_lengths(self) -> list[int]:
        if self.train_ids is None:
            return self.known_train_lengths or []
        return self.train_ids.lengths

    @property
    def train_samples(self) -> int:
        return len(self.train_lengths)

    def without_train_ids(self) -> PreparedData:
        lengths = list(self.train_lengths)
        return replace(self, train_ids=None, train_labels=None, train_masks=None, known_train_lengths=lengths)

    def truncate_train(self, index: int, limit: int) -> None:
        """Cut training sample `index` to `limit` tokens (its length, where only lengths are held; its loss mask
        shares the ids' lengths)."""
        if self.train_ids is not None:
            self.train_ids.truncate(index, limit)
        else:
            assert self.known_train_lengths is not None
            self.known_train_lengths[index] = min(self.known_train_lengths[index], limit)

    def masks(self, split: str) -> TokenSeqs | None:
        """The loss masks of the train or eval samples (None: every token is trained on)."""
        return self.train_masks if split == "train" else self.eval_masks

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
    } | ({"sft": _sft_identity(recipe, tokenizer)} if recipe.task == "causal-lm" else {})


def _sft_identity(recipe: Recipe, tokenizer: Any) -> dict:
    """The SFT settings as declared (what they resolve to follows from them and the data) and the template's digest."""
    d = recipe.data
    template = template_text(d.chat_template, tokenizer) or ""
    return {"format": d.format, "loss_on": d.loss_on, "template": hashlib.sha256(template.encode()).hexdigest()}


def _tokenizer_name(recipe: Recipe) -> str:
    name = recipe.tokenizer.pretrained or recipe.model.pretrained
    return repr(name) if name else "(word-level, trained on the data)"


def _sft_format(recipe: Recipe, source: RecordSource, tokenizer: Any) -> SFTFormat:
    """The data's format, loss and template (sequence classification: text); bad combinations refused here."""
    d = recipe.data
    if recipe.task != "causal-lm":
        return SFTFormat("text", "all", None)
    columns = source.column_names()
    return resolve(d.format, d.loss_on, d.chat_template, columns, d.text_field, tokenizer, _tokenizer_name(recipe))


def _encoded(source: RecordSource, encode: Callable[[dict], tuple]) -> Iterator[tuple[str, dict, tuple]]:
    """(split, columns, (ids, masks)) of each chunk: a thread encodes one chunk (the Rust encoder releases the
    GIL) while the next is read or generated."""
    with ThreadPoolExecutor(1) as pool:
        pending = None
        for split, columns in source.chunks():
            future = pool.submit(encode, columns)
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
        fmt = detect_format(d.format, source.column_names(), d.text_field) if recipe.task == "causal-lm" else "text"
        markers = template_markers(template_text(d.chat_template, None)) if fmt != "text" else []
        tokenizer = build_tokenizer(recipe, source.train_texts(WORD_LEVEL_SAMPLE, fmt), markers)
        save_tokenizer(tokenizer, directory)
    sft = _sft_format(recipe, source, tokenizer)
    texts = encoder_for(tokenizer)
    if recipe.task == "causal-lm":
        encode = encoder_for_format(tokenizer, sft, texts, d.text_field)
    else:
        encode = lambda columns: (texts(text_column(columns, recipe)), None)  # noqa: E731
    dtype = token_dtype(len(tokenizer))
    writers = {split: SplitWriter(directory, split, dtype) for split in ("train", "eval")}
    counts = {split: OverlongCounts() for split in writers}
    total = source.count()
    interval = 0.5 if sys.stderr.isatty() else 30.0
    with tqdm(total=total, unit="doc", desc="tokenizing", disable=total < _PROGRESS_FROM, mininterval=interval) as bar:
        for split, columns, (encoded, masks) in _encoded(source, encode):
            first = counts[split].documents
            if masks is None:
                samples, origin, made = fit_documents(encoded, d.max_length, d.overlong, split, first)
            else:
                samples, masks, origin, made = fit_masked(encoded, masks, d.max_length, d.overlong, split, first)
            labels = None
            if recipe.task == "sequence-classification":
                values = _labels(label_column(columns, recipe), recipe.model.num_labels, first)
                labels = [values[i] for i in origin]
            writers[split].append(samples, labels, masks)
            counts[split].add(made)
            bar.update(made.documents)
    if sft.masked and counts["train"].documents and not counts["train"].samples:
        raise UsageError(
            f"no training sample has a token to train on (data.loss_on {sft.loss_on}: every one of the "
            f"{counts['train'].documents} {sft.format} records has no {sft.loss_on} token within data.max_length "
            f"{d.max_length})"
        )
    splits = {split: writer.finish(sft.masked) for split, writer in writers.items()}
    resolved = {"format": sft.format, "loss_on": sft.loss_on}
    return {"splits": splits, "counts": {split: c.as_dict() for split, c in counts.items()}, "sft": resolved}


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
        train_masks=train.masks,
        eval_masks=evals.masks,
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
        # SFT: the format and loss the data resolved to, records dropped with nothing to train on, trained tokens
        **entry.meta.get("sft", {}),
        "documents_dropped": sum(c.get("dropped", 0) for c in counts.values()),
        "trained_tokens": {split: c.get("trained_tokens") for split, c in counts.items()},
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
