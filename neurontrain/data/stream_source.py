"""Streaming's I/O: the JSON-lines shards of data.path (local, or an s3:// prefix through boto3) read from a
byte offset, tokenized in chunks, and the run's stream (`Stream`): eval set, tokenizer sample, training batches.

Every worker reads the whole stream and keeps its own rows of each global batch (`data/sharding.py`), so the
workers need no coordination and a restart with another number of workers continues at the same position.
"""

from __future__ import annotations

import functools
import glob
import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from neurontrain.data.collate import Collator
from neurontrain.data.streaming import (
    POSITION_KEY,
    Document,
    Row,
    StreamPosition,
    global_batches,
    held_out,
    pack_rows,
    shard_order,
)
from neurontrain.data.tokenizers import build_tokenizer, encoder_for
from neurontrain.errors import NeurontrainError, UsageError, first_line
from neurontrain.recipe import Recipe

SUFFIXES = (".jsonl", ".json")
CHUNK = 256  # records tokenized in one call
Line = tuple[int, int, int, str]  # (record, its byte, the next record's byte, text)


@functools.cache
def _s3_client() -> Any:
    """One client per process (its threads share it), endpoint from AWS_ENDPOINT_URL when set."""
    import boto3  # lazy: loaded with the first S3 client

    return boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None)


def _s3_parts(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    if not parsed.netloc:
        raise UsageError(f"data.path {url!r}: expected s3://bucket/prefix")
    return parsed.netloc, parsed.path.lstrip("/")


def list_shards(path: str) -> list[str]:
    """The shards of data.path in their canonical (sorted) order: an s3:// prefix's objects, a directory's
    files, a glob's matches or one file; only names ending in .jsonl or .json."""
    if path.startswith("s3://"):
        bucket, prefix = _s3_parts(path)
        try:
            pages = _s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
        except Exception as exc:  # botocore raises many types; the user needs one line
            raise UsageError(f"data.path {path}: cannot list the shards: {first_line(exc)}") from None
        found = [f"s3://{bucket}/{k}" for k in keys]
    elif any(c in path for c in "*?["):
        found = glob.glob(path, recursive=True)
    elif Path(path).is_dir():
        found = [str(p) for p in Path(path).iterdir() if p.is_file()]
    elif Path(path).is_file():
        found = [path]
    else:
        raise UsageError(f"data.path not found: {path}")
    shards = sorted(s for s in found if s.endswith(SUFFIXES))
    if not shards:
        raise UsageError(f"data.path {path}: no JSON-lines shards (files ending in {' or '.join(SUFFIXES)})")
    return shards


def _chunks(shard: str, start: int) -> Iterator[bytes]:
    if not shard.startswith("s3://"):
        with open(shard, "rb") as fh:
            fh.seek(start)
            yield from iter(functools.partial(fh.read, 1 << 20), b"")
        return
    from botocore.exceptions import ClientError  # lazy: with boto3

    bucket, key = _s3_parts(shard)
    try:
        ranged = {"Range": f"bytes={start}-"} if start else {}
        body = _s3_client().get_object(Bucket=bucket, Key=key, **ranged)["Body"]
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "InvalidRange":  # the position is the shard's end
            return
        raise NeurontrainError(f"cannot read shard {shard}: {first_line(exc)}") from None
    yield from body.iter_chunks(1 << 20)


def read_lines(shard: str, byte: int = 0, record: int = 0) -> Iterator[tuple[int, int, int, bytes]]:
    """(record, byte, next byte, line) of the shard's lines from `byte` (where line `record` starts)."""
    rest = b""
    for chunk in _chunks(shard, byte):
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            yield record, byte, byte + len(line) + 1, line
            record, byte = record + 1, byte + len(line) + 1
    if rest:
        yield record, byte, byte + len(rest), rest


def texts(shard: str, text_field: str, byte: int = 0, record: int = 0) -> Iterator[Line]:
    """The shard's records as text, blank lines skipped, from `byte`."""
    for number, at, following, line in read_lines(shard, byte, record):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            raise UsageError(f"{shard} line {number + 1}: not JSON") from None
        if not isinstance(value, dict) or text_field not in value:
            raise UsageError(f"{shard} line {number + 1}: no field {text_field!r} (data.text_field)")
        yield number, at, following, str(value[text_field])


@dataclass(frozen=True)
class Head:
    """The stream's first documents in canonical order: the eval set, and the tokenizer's sample."""

    eval_texts: list[str]
    sample: list[str]
    holdout: dict[str, int]  # shard -> its first lines that are eval documents


def read_head(shards: list[str], text_field: str, eval_count: int, sample_count: int) -> Head:
    evals: list[str] = []
    sample: list[str] = []
    holdout: dict[str, int] = {}
    for shard in shards:
        for record, _, _, text in texts(shard, text_field):
            if len(evals) < eval_count:
                evals.append(text)
                holdout[shard] = record + 1
            elif len(sample) >= sample_count:
                return Head(evals, sample, holdout)
            sample.append(text)
    if len(evals) < eval_count or len(sample) == len(evals):
        raise UsageError(
            f"the stream has {len(evals)} documents: data.eval_samples {eval_count} leaves none to train on"
        )
    return Head(evals, sample, holdout)


@dataclass(frozen=True)
class Stream:
    """A run's stream: its shards, how documents become token ids, and its rows' length."""

    shards: list[str]
    text_field: str
    tokenize: Callable[[list[str]], list[list[int]]]
    pad_id: int
    row_length: int
    seed: int
    shuffle: bool
    holdout: dict[str, int]
    batch_size: int  # rows a worker trains on a micro-step (data.batch_size as the plan resolved it)

    def documents(self, start: StreamPosition) -> Iterator[Document]:
        """The training documents from `start` on, epoch after epoch (the eval documents skipped)."""
        epoch, first = start.epoch, True
        while True:
            found = False
            order = shard_order(len(self.shards), epoch, self.seed, self.shuffle)
            for k in range(start.shard if first else 0, len(order)):
                at = start if first and k == start.shard else StreamPosition(epoch, k)
                for doc in self._shard_documents(self.shards[order[k]], at):
                    found = True
                    yield doc
            if not found and not first:
                raise UsageError(f"the stream has no training documents (epoch {epoch} found none)")
            epoch, first = epoch + 1, False

    def _shard_documents(self, shard: str, at: StreamPosition) -> Iterator[Document]:
        lines = texts(shard, self.text_field, at.byte, at.record)
        kept = (line for line in lines if not held_out(line[0], shard, self.holdout))
        offset = at.offset
        while chunk := list(itertools.islice(kept, CHUNK)):
            for (record, byte, following, _), ids in zip(chunk, self.tokenize([c[3] for c in chunk]), strict=True):
                yield Document(StreamPosition(at.epoch, at.shard, record, byte, offset), following, ids)
                offset = 0

    def batches(self, rank: int, world: int, start: dict | None, count: int) -> Iterator[dict]:
        """Worker `rank`'s collated micro-batches of the next `count` global batches from `start` (a checkpoint's
        position; None: the beginning), each with the position after it under POSITION_KEY, as a checkpoint
        after that batch records it. Each global batch is batch_size x world rows; the worker keeps its own."""
        batch_size = self.batch_size
        at = StreamPosition() if start is None else StreamPosition.from_dict(start)
        rows = pack_rows(self.documents(at), self.row_length)
        for planned in itertools.islice(global_batches(rows, batch_size * world, self.row_length), count):
            collate = Collator(planned.pieces, None, "causal-lm", batch_size, self.pad_id, rank, world)
            yield collate(planned.batch) | {POSITION_KEY: planned.after.as_dict()}


WORD_LEVEL_SAMPLE = 10_000  # documents a word-level tokenizer of a streaming run is trained on


@dataclass(frozen=True)
class StreamData:
    """What planning needs of a stream: the stream, its tokenizer and the eval documents' rows."""

    stream: Stream
    tokenizer: Any
    eval_rows: list[Row]


def open_stream(recipe: Recipe) -> StreamData:
    """List data.path's shards and read the stream's head: the first data.eval_samples documents (the eval
    set, held out of training) and, for a word-level tokenizer, the first WORD_LEVEL_SAMPLE documents it is
    trained on (a pretrained tokenizer needs no sample). The same head gives every worker the same tokenizer."""
    data = recipe.data
    assert data.path is not None
    shards = list_shards(data.path)
    sample = WORD_LEVEL_SAMPLE if recipe.tokenizer.word_level is not None else 0
    head = read_head(shards, data.text_field, data.eval_samples, sample)
    tokenizer = build_tokenizer(recipe, head.sample)
    stream = Stream(
        shards,
        data.text_field,
        encoder_for(tokenizer),
        int(tokenizer.pad_token_id),
        data.max_length,
        data.seed,
        data.shuffle,
        head.holdout,
        data.batch_size,
    )
    docs = [Document(StreamPosition(record=i), i + 1, ids) for i, ids in enumerate(stream.tokenize(head.eval_texts))]
    return StreamData(stream, tokenizer, list(pack_rows(docs, data.max_length, partial_last=True)))


def stream_note(stream: Stream) -> str:
    held = sum(stream.holdout.values())
    return (
        f"data.streaming: {len(stream.shards)} shards read as a stream by every worker, packed into rows of "
        f"{stream.row_length} tokens (a document continues in the next row); the first {held} lines are the eval set"
    )
