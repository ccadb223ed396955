"""Load records (generated, local files, or a hub dataset), build or load the tokenizer, tokenize."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from neurontrain.data import synthetic
from neurontrain.errors import UsageError, first_line
from neurontrain.recipe import Recipe

_SPECIALS = {
    "sequence-classification": {"pad": "[PAD]", "unk": "[UNK]", "bos": "[CLS]", "eos": "[SEP]"},
    "causal-lm": {"pad": "<pad>", "unk": "<unk>", "bos": "<s>", "eos": "</s>"},
}


@dataclass
class PreparedData:
    """The tokenized data. Where a data service makes the training batches (`data.service`), the training
    side holds a copy without the training ids (`without_train_ids`): what planning needs, the lengths."""

    tokenizer: Any
    pad_id: int
    train_ids: list[list[int]] | None  # None: the ids stay where the batches are made
    train_labels: list[int] | None
    eval_ids: list[list[int]]
    eval_labels: list[int] | None
    truncated: int
    known_train_lengths: list[int] | None = None  # set where train_ids is None

    @property
    def train_lengths(self) -> list[int]:
        if self.train_ids is None:
            return list(self.known_train_lengths or [])
        return [len(ids) for ids in self.train_ids]

    @property
    def train_samples(self) -> int:
        return len(self.train_ids) if self.train_ids is not None else len(self.known_train_lengths or [])

    def without_train_ids(self) -> PreparedData:
        return replace(self, train_ids=None, train_labels=None, known_train_lengths=self.train_lengths)

    def truncate_train(self, index: int, limit: int) -> None:
        """Cut training sample `index` to `limit` tokens (its length, where only lengths are held)."""
        if self.train_ids is not None:
            self.train_ids[index] = self.train_ids[index][:limit]
        else:
            assert self.known_train_lengths is not None
            self.known_train_lengths[index] = min(self.known_train_lengths[index], limit)

    @property
    def eval_lengths(self) -> list[int]:
        return [len(ids) for ids in self.eval_ids]


def _load_file_records(recipe: Recipe, split: str) -> list[dict]:
    data = recipe.data
    try:
        import datasets  # lazy: only file and hub sources need it, and it is slow to import
    except ImportError:  # pragma: no cover - datasets is a dependency
        raise UsageError("data.source needs the 'datasets' package: pip install datasets") from None
    datasets.disable_progress_bars()
    try:
        if data.source == "hub":
            ds = datasets.load_dataset(data.path, data.name, split=split)
        else:
            path = Path(data.path)
            if not path.exists():
                raise UsageError(f"data.path not found: {path}")
            ds = datasets.load_dataset(data.source, data_files={split: str(path)}, split=split)
    except UsageError:
        raise
    except Exception as exc:  # datasets raises many types; the user needs one line
        raise UsageError(f"cannot load data ({data.source} {data.path}, split {split}): {first_line(exc)}") from None
    return list(ds)


def _records(recipe: Recipe) -> tuple[list[dict], list[dict]]:
    data = recipe.data
    if data.source in ("synthetic-sentiment", "synthetic-text"):
        n_train = data.train_samples or 2000
        make = synthetic.sentiment_reviews if data.source == "synthetic-sentiment" else synthetic.story_text
        records = make(n_train + data.eval_samples, data.seed)
        return records[:n_train], records[n_train:]
    train = _load_file_records(recipe, data.split)
    if data.eval_split:
        evals = _load_file_records(recipe, data.eval_split)
        if data.eval_samples:
            evals = evals[: data.eval_samples]
    elif data.eval_samples:
        if data.eval_samples >= len(train):
            raise UsageError(f"data.eval_samples {data.eval_samples} leaves no training data ({len(train)} records)")
        train, evals = train[: -data.eval_samples], train[-data.eval_samples :]
    else:
        evals = []
    if data.train_samples:
        train = train[: data.train_samples]
    return train, evals


def _field(records: list[dict], field: str, what: str) -> list:
    if records and field not in records[0]:
        raise UsageError(f"data.{what} {field!r} is not a column of the data (columns: {sorted(records[0])})")
    return [r[field] for r in records]


def build_tokenizer(recipe: Recipe, corpus: list[str]) -> Any:
    spec = recipe.tokenizer
    if spec.word_level is not None:
        return _word_level_tokenizer(recipe, corpus)
    from transformers import AutoTokenizer  # lazy: a second to import

    source = spec.pretrained or recipe.model.pretrained
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as exc:
        raise UsageError(f"cannot load tokenizer {source!r}: {first_line(exc)}") from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise UsageError(f"tokenizer {source!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


def _word_level_tokenizer(recipe: Recipe, corpus: list[str]) -> Any:
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors  # lazy: with transformers, below
    from tokenizers.models import WordLevel
    from tokenizers.trainers import WordLevelTrainer
    from transformers import PreTrainedTokenizerFast  # lazy: a second to import

    spec = recipe.tokenizer.word_level
    names = _SPECIALS[recipe.task]
    specials = [names["pad"], names["unk"], names["bos"], names["eos"]]
    tok = Tokenizer(WordLevel(unk_token=names["unk"]))
    if spec.lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, WordLevelTrainer(vocab_size=spec.vocab_size, special_tokens=specials))
    bos, eos = names["bos"], names["eos"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=names["pad"], unk_token=names["unk"], bos_token=bos, eos_token=eos
    )


def _tokenize(
    tokenizer: Any, texts: list[str], max_length: int, overlong: str, split: str
) -> tuple[list[list[int]], int]:
    if not texts:
        return [], 0
    encoded = tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]
    truncated = 0
    for i, ids in enumerate(encoded):
        if len(ids) > max_length:
            if overlong == "fail":
                raise UsageError(
                    f"{split} sample {i} has {len(ids)} tokens, more than data.max_length {max_length} "
                    "(set data.overlong: truncate to cut such samples)"
                )
            encoded[i] = ids[:max_length]
            truncated += 1
    return encoded, truncated


def prepare_data(recipe: Recipe) -> PreparedData:
    data = recipe.data
    train_records, eval_records = _records(recipe)
    if not train_records:
        raise UsageError("the training data is empty")
    train_texts = [str(t) for t in _field(train_records, data.text_field, "text_field")]
    eval_texts = [str(t) for t in _field(eval_records, data.text_field, "text_field")] if eval_records else []
    tokenizer = build_tokenizer(recipe, train_texts)
    train_ids, cut_train = _tokenize(tokenizer, train_texts, data.max_length, data.overlong, "train")
    eval_ids, cut_eval = _tokenize(tokenizer, eval_texts, data.max_length, data.overlong, "eval")
    train_labels = eval_labels = None
    if recipe.task == "sequence-classification":
        train_labels = _labels(_field(train_records, data.label_field, "label_field"), recipe.model.num_labels)
        if eval_records:
            eval_labels = _labels(_field(eval_records, data.label_field, "label_field"), recipe.model.num_labels)
    return PreparedData(
        tokenizer, int(tokenizer.pad_token_id), train_ids, train_labels, eval_ids, eval_labels, cut_train + cut_eval
    )


def _labels(values: list, num_labels: int) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < num_labels:
            raise UsageError(f"label {v!r} of sample {i} is not an integer in [0, {num_labels}) (model.num_labels)")
        out.append(v)
    return out
