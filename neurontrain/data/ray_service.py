"""The data service on Ray Data: the toolkit's sources, tokenizer and collator run on data-labelled nodes.

`prepare_on_data_nodes` tokenizes there once (a task pinned by node label) and keeps the ids in that node's
object store; the training side gets the lengths, which is all planning needs. Each training worker then
streams its micro-batches (`RayBatchSource`): a Ray Data pipeline pinned to the data nodes
(`ExecutionOptions.label_selector`) whose collation actors hold the ids and make the worker's rows of the
plan's global batch at each position, in plan order. Ray is the optional extra `neurontrain[ray]`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neurontrain.data.collate import Collator
from neurontrain.data.rows import decode_row, encode_row
from neurontrain.data.service import LABEL_KEY, BatchIndex, Collation, StreamRecord, in_lockstep
from neurontrain.data.sources import PreparedData, prepare_data
from neurontrain.data.token_seqs import TokenSeqs
from neurontrain.errors import UsageError
from neurontrain.recipe import DataServiceSpec, Recipe


def import_ray() -> Any:
    try:
        import ray  # lazy: the optional extra neurontrain[ray], and slow to import
    except ImportError:
        raise UsageError('data.service.kind ray needs Ray: pip install "neurontrain[ray]"') from None
    return ray


@dataclass
class ServedData:
    """The tokenized data as the two sides hold it: the ids on a data node, the lengths here; and how the
    training workers stream from it."""

    ids: Any  # ObjectRef of the TrainIds, kept in the preparing data node's object store
    lengths: PreparedData  # the same without the training ids
    spec: DataServiceSpec
    record_dir: Path | None = None  # where each worker's stream record goes (data_service/rank_R.json)

    def source_for(self, collation: Collation) -> RayBatchSource:
        return RayBatchSource(self, collation)


def selector(role_label: str) -> dict[str, str]:
    return {LABEL_KEY: role_label}


@dataclass
class TrainIds:
    """What the collation actors need of the tokenized data (not the tokenizer: unpickling it would import
    transformers in every actor)."""

    ids: TokenSeqs
    labels: list[int] | None


def _prepare(recipe: Recipe) -> tuple[TrainIds, PreparedData]:
    data = prepare_data(recipe)
    assert data.train_ids is not None
    if data.train_masks is not None:
        raise UsageError(f"data.service: {data.store.get('format')} data (a loss mask) is not served by Ray yet")
    return TrainIds(data.train_ids, data.train_labels), data.without_train_ids()


def prepare_on_data_nodes(recipe: Recipe, record_dir: Path | None = None) -> ServedData:
    """Load and tokenize on a data node; the full result stays there (the caller owns it)."""
    ray = import_ray()
    task = ray.remote(_prepare).options(
        num_returns=2, num_cpus=1, label_selector=selector(recipe.data.service.data_label), max_retries=1
    )
    ids, lengths = task.remote(recipe)
    return ServedData(ids, ray.get(lengths), recipe.data.service, record_dir)


class CollateWorkerRows:
    """A Ray Data actor on a data node: the worker's collated rows of the global batch at each position."""

    def __init__(self, ids: list, collation: Collation) -> None:
        ray = import_ray()
        data: TrainIds = ray.get(ids[0])
        # the plan's lengths may be shorter (fixed buckets below data.max_length): cut the ids as planning did
        limits = collation.batcher.lengths
        token_ids = [row[:limit] for row, limit in zip(data.ids, limits, strict=True)]
        self.collate = Collator(
            token_ids,
            data.labels,
            collation.task,
            collation.batch_size,
            collation.pad_id,
            collation.rank,
            collation.world,
            collation.max_docs,
        )
        self.index = BatchIndex(collation.batcher)
        context = ray.get_runtime_context()
        self.node = f"{context.get_node_labels().get(LABEL_KEY, '?')}@{context.get_node_id()[:12]}"

    def __call__(self, positions: dict) -> dict:
        (position,) = positions["position"].tolist()  # batch_size 1: one row, one position
        return encode_row(int(position), self.collate.arrays(self.index.at(int(position))), self.node)


class RayBatchSource:
    """One training worker's stream of micro-batches from the data nodes, checked against the plan."""

    def __init__(self, served: ServedData, collation: Collation) -> None:
        self.served, self.collation, self.spec = served, collation, served.spec
        self.record = StreamRecord(collation.rank)

    def __call__(self, start: int, count: int) -> Iterator[dict]:
        ray = import_ray()
        context = ray.data.DataContext.get_current()
        context.execution_options.label_selector = selector(self.spec.data_label)
        context.execution_options.preserve_order = True
        context.enable_progress_bars = False
        positions = ray.data.range(count).map_batches(
            _positions_from, fn_kwargs={"start": start}, batch_size=None, num_cpus=1
        )
        rows = positions.map_batches(
            CollateWorkerRows,
            fn_constructor_args=([self.served.ids], self.collation),
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=self.spec.concurrency),
            num_cpus=1,
        )
        delivered = rows.iter_batches(batch_size=1, prefetch_batches=self.spec.prefetch_batches)
        stream = (decode_row(row) for row in delivered)
        planned = self.collation.batcher.iterate(start)
        yield from in_lockstep(stream, planned, start, self.record)
        self.write_record()

    def write_record(self) -> None:
        """rank_R.json in the record folder: what this worker received (positions, lengths, producing nodes)."""
        folder = self.served.record_dir
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank_{self.collation.rank}.json").write_text(json.dumps(self.record.as_dict()))


def _positions_from(batch: dict, start: int) -> dict:
    return {"position": batch["id"] + start}
