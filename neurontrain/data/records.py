"""A recipe's records, read chunk by chunk: generated, local files, or a hub dataset through `datasets`.

A chunk is ("train" | "eval", {column: values}); all the training chunks come first. Nothing holds the whole data
set in Python objects: the generated corpora are produced record by record, and `datasets` keeps file and hub data
in its memory-mapped Arrow cache. `identity` says what the content is, for the tokenized store's key.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from neurontrain.data import synthetic
from neurontrain.errors import UsageError, first_line
from neurontrain.recipe import Recipe

CHUNK = 8192
Chunk = tuple[str, dict[str, list]]
GENERATED_COLUMNS = {
    "synthetic-sentiment": ("content", "label"),
    "synthetic-text": ("text",),
    "synthetic-chat": ("messages",),
}
_GENERATORS = {
    "synthetic-sentiment": synthetic.iter_sentiment_reviews,
    "synthetic-text": synthetic.iter_story_text,
    "synthetic-chat": synthetic.iter_conversations,
}


def _columns(records: list[dict]) -> dict[str, list]:
    if not records:
        return {}
    return {name: [r[name] for r in records] for name in records[0]}


class RecordSource:
    """The records of a recipe's data section."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.data = recipe.data
        self._loaded: tuple[Any, Any] | None = None

    @property
    def generated(self) -> bool:
        return self.data.source in GENERATED_COLUMNS

    def column_names(self) -> list[str]:
        """The records' fields (a file or hub source is loaded to read them)."""
        if self.generated:
            return list(GENERATED_COLUMNS[self.data.source])
        return list(self._datasets()[0].column_names)

    def identity(self) -> dict:
        """What the records are: the generator and its seed, a local file's path, size and modification time (as
        `datasets` fingerprints local files), or a hub dataset's fingerprint."""
        d = self.data
        out = {"source": d.source, "train_samples": d.train_samples, "eval_samples": d.eval_samples}
        if self.generated:
            return out | {"seed": d.seed}
        out |= {"path": d.path, "name": d.name, "split": d.split, "eval_split": d.eval_split}
        if d.source in ("hub", "disk"):
            train, evals = self._datasets()
            return out | {"fingerprints": [getattr(ds, "_fingerprint", None) for ds in (train, evals)]}
        path = Path(d.path)
        if not path.exists():
            raise UsageError(f"data.path not found: {path}")
        stat = path.stat()
        return out | {"resolved": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    def count(self) -> int:
        """Records in both splits (a file or hub source is loaded to count them)."""
        if self.generated:
            return (self.data.train_samples or 2000) + self.data.eval_samples
        return sum(len(ds) for ds in self._datasets() if ds is not None)

    def chunks(self) -> Iterator[Chunk]:
        if self.generated:
            yield from self._generated_chunks()
            return
        train, evals = self._datasets()
        yield from _dataset_chunks("train", train)
        if evals is not None:
            yield from _dataset_chunks("eval", evals)

    def train_texts(self, limit: int, fmt: str = "text") -> Iterator[str]:
        """The first `limit` training texts (a tokenizer trained on the corpus reads them): a text field, or
        the roles and contents of conversations and the prompts and completions of prompt-completion data."""
        field = self.data.text_field
        if fmt == "text":
            texts = (str(t) for split, cols in self.chunks() if split == "train" for t in _column(cols, field, "text"))
        else:
            fields = ("messages",) if fmt == "messages" else ("prompt", "completion")
            texts = (
                " ".join(_strings(record))
                for split, cols in self.chunks()
                if split == "train"
                for record in zip(*(cols[f] for f in fields))
            )
        return itertools.islice(texts, limit)

    def _generated_chunks(self) -> Iterator[Chunk]:
        d = self.data
        n_train = d.train_samples or 2000
        records = _GENERATORS[d.source](n_train + d.eval_samples, d.seed)
        for split, count in (("train", n_train), ("eval", d.eval_samples)):
            left = count
            while left > 0:
                batch = list(itertools.islice(records, min(CHUNK, left)))
                left -= len(batch)
                yield split, _columns(batch)

    def _datasets(self) -> tuple[Any, Any]:
        if self._loaded is None:
            self._loaded = _load_splits(self.recipe)
        return self._loaded


def _strings(value: object) -> Iterator[str]:
    """The strings in a record's value (message roles and contents, nested)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _column(columns: dict[str, list], field: str | None, what: str) -> list:
    if field not in columns:
        raise UsageError(f"data.{what}_field {field!r} is not a column of the data (columns: {sorted(columns)})")
    return columns[field]


def text_column(columns: dict[str, list], recipe: Recipe) -> list[str]:
    return [str(t) for t in _column(columns, recipe.data.text_field, "text")]


def label_column(columns: dict[str, list], recipe: Recipe) -> list:
    return _column(columns, recipe.data.label_field, "label")


def _dataset_chunks(split: str, ds: Any) -> Iterator[Chunk]:
    for start in range(0, len(ds), CHUNK):
        yield split, ds[start : start + CHUNK]


def _load(recipe: Recipe, split: str) -> Any:
    data = recipe.data
    try:
        import datasets  # lazy: only file and hub sources need it, and it is slow to import
    except ImportError:  # pragma: no cover - datasets is a dependency
        raise UsageError("data.source needs the 'datasets' package: pip install datasets") from None
    datasets.disable_progress_bars()
    try:
        if data.source == "hub":
            return datasets.load_dataset(data.path, data.name, split=split)
        if data.source == "disk":
            return _from_disk(datasets, Path(data.path), split)
        path = Path(data.path)
        if not path.exists():
            raise UsageError(f"data.path not found: {path}")
        return datasets.load_dataset(data.source, data_files={split: str(path)}, split=split)
    except UsageError:
        raise
    except Exception as exc:  # datasets raises many types; the user needs one line
        raise UsageError(f"cannot load data ({data.source} {data.path}, split {split}): {first_line(exc)}") from None


def _from_disk(datasets: Any, path: Path, split: str) -> Any:
    """A split of a directory `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote (load_from_disk)."""
    if not path.exists():
        raise UsageError(f"data.path not found: {path}")
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UsageError(f"data.path {path} has the splits {sorted(loaded)}, not {split!r} (data.split)")
        return loaded[split]
    return loaded


def _load_splits(recipe: Recipe) -> tuple[Any, Any]:
    """The training and eval datasets (eval None: no eval data), cut to the recipe's sample counts."""
    data = recipe.data
    train = _load(recipe, data.split)
    evals = None
    if data.eval_split:
        evals = _load(recipe, data.eval_split)
        if data.eval_samples:
            evals = evals.select(range(min(data.eval_samples, len(evals))))
    elif data.eval_samples:
        if data.eval_samples >= len(train):
            raise UsageError(f"data.eval_samples {data.eval_samples} leaves no training data ({len(train)} records)")
        evals = train.select(range(len(train) - data.eval_samples, len(train)))
        train = train.select(range(len(train) - data.eval_samples))
    if data.train_samples:
        train = train.select(range(min(data.train_samples, len(train))))
    return train, evals
