"""`summary.json`: the one definition of what a run reports when it ends.

The trainer and the Lightning session both make theirs with `build_summary`, the one place that fills the
fields from what a run measured; `run` adds the cache counters, prints `CONSOLE_FIELDS` as one JSON line
and writes the whole summary atomically. docs/outputs.md's table of fields is `fields_table()` (a test checks
that the two agree).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neurontrain.fileio import write_file_atomic
from neurontrain.loop.guard import RecompilationGuard
from neurontrain.loop.mfu import mfu_of


@dataclass(kw_only=True)
class RunSummary:
    """What a run reports when it ends; each field's comment is its description in docs/outputs.md."""

    recipe: str  # recipe name
    backend: str  # backend the run used (neuron, xla-cpu, xla-cuda, native, eager)
    steps: int  # optimizer steps of the run (train.max_steps)
    resumed_from_step: int | None = None  # step of the checkpoint the run resumed from; null for a fresh run
    first_loss: float | None = None  # training loss of the first logged step
    final_loss: float | None = None  # training loss of the last logged step
    compilations: int  # graphs compiled during the run (the backend's own counter)
    compile_seconds: float  # seconds spent compiling them
    distinct_graphs: int  # distinct graph keys (step kind, shape) the run executed
    expected_graphs: int  # graph keys the plan expected
    unexpected_graphs: int  # graphs the plan did not expect (each also a recompilation-guard report)
    unexpected: list[dict] = field(default_factory=list)  # details of each unexpected graph: key, step, shapes, reason
    uncompiled_graphs: list[dict] = field(default_factory=list)  # planned graph keys that ran eagerly (native)
    hidden_host_syncs: list[dict]  # device-to-host reads inside a step (.item(), print(tensor), ...)
    checked_against_manifest: bool  # whether compiled graphs were checked against a precompile manifest
    world_size: int  # data-parallel workers
    per_worker_batch: int  # rows per micro-batch on each worker
    grad_accum: int  # micro-batches per optimizer step
    effective_batch: int  # rows per optimizer step over all workers
    samples_trained: int = 0  # training samples the run's steps cover, all workers (a packed row holds several)
    restarts: int  # times the workers were restarted after a failure (torchrun elastic)
    buckets: list[int] = field(default_factory=list)  # planned sequence-length buckets
    bucket_mode: str  # how the buckets were chosen: fixed, max, dynamic, auto (cost model) or packed (data.packing)
    buckets_used: list[int] = field(default_factory=list)  # buckets that training batches actually used
    tokens_per_second: float  # real (non-padding) training tokens a second, all workers
    padding_fraction: float  # share of batch slots that were padding
    wall_seconds: float  # seconds from set-up to the end of the loop
    mfu: float | None = None  # model FLOPs utilisation over wall_seconds (null on CPU or an unknown device: mfu_basis)
    mfu_basis: dict | None = None  # model_flops (planner's count), device, devices, peak FLOP/s each, or the reason
    eval_loss: float | None = None  # loss of the last evaluation, when the recipe evaluates
    eval_accuracy: float | None = None  # accuracy of the last evaluation (sequence classification)
    device_bytes: list[dict] = field(default_factory=list)  # per worker: live device-tensor bytes by planner category
    compile_cache: dict | None = None  # what run pulled/pushed; on native also `native` (artifacts loaded, cache hits)
    rank_checks: dict | None = None  # several workers: graph shapes compared (where the plan introduces a graph)
    neuron_cache: dict | None = None  # on Neuron: runtime cache root, modules compiled at run time, cache hits
    compiles: list[dict] = field(default_factory=list)  # compile timeline: step, graph key, graphs, seconds, expected
    bucket_tokens: list[dict] = field(default_factory=list)  # per bucket: training micro-batches, real tokens, slots
    memory_plan: dict | None = None  # the memory planner's candidates (GiB per category) and its choice
    model_fingerprint: str | None = None  # hash of model, task and tokenizer settings (compare needs them equal)
    data_fingerprint: str | None = None  # hash of the data settings that pick the samples (compare needs them equal)
    learning_rate: float | None = None  # peak learning rate (train.optimizer.lr)
    instance_type: str | None = None  # NEURONTRAIN_INSTANCE_TYPE, SageMaker's instance type or the recipe's cluster
    data: dict = field(default_factory=dict)  # tokenized data: store, documents tokenized (0: reused), tokens kept/cut

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSummary:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def console(self) -> dict[str, Any]:
        """The one JSON line `run` prints when it ends."""
        return {name: getattr(self, name) for name in CONSOLE_FIELDS}

    def write(self, output_dir: Path) -> None:
        data = json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n"
        write_file_atomic(Path(output_dir) / "summary.json", data.encode())


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """Training tokens over the run's wall time: real (non-padding) tokens and batch slots, all workers."""

    real_tokens: int
    slot_tokens: int
    wall_seconds: float


def build_summary(
    *,
    recipe: str,
    backend: str,
    steps: int,
    losses: list[float],
    compile_counts: tuple[int, float],
    guard: RecompilationGuard,
    expected_graphs: int,
    world: int,
    batch: int,
    accum: int,
    throughput: Throughput,
    **fields: Any,
) -> RunSummary:
    """The summary of a run from what it measured: `losses` (the logged training losses; the first and last are
    reported), `compile_counts` (graphs compiled and seconds spent, during the run), the recompilation guard;
    `fields` are the rest of RunSummary's fields by name."""
    wall = throughput.wall_seconds
    return RunSummary(
        recipe=recipe,
        backend=backend,
        steps=steps,
        first_loss=losses[0] if losses else None,
        final_loss=losses[-1] if losses else None,
        compilations=compile_counts[0],
        compile_seconds=compile_counts[1],
        distinct_graphs=guard.distinct_graphs,
        expected_graphs=expected_graphs,
        unexpected_graphs=len(guard.unexpected),
        unexpected=guard.unexpected,
        uncompiled_graphs=guard.uncompiled,
        hidden_host_syncs=guard.hidden_syncs,
        world_size=world,
        per_worker_batch=batch,
        grad_accum=accum,
        effective_batch=batch * world * accum,
        tokens_per_second=throughput.real_tokens / wall if wall > 0 else 0.0,
        padding_fraction=1.0 - throughput.real_tokens / max(throughput.slot_tokens, 1),
        wall_seconds=wall,
        mfu=mfu_of(fields.get("mfu_basis"), wall),
        **fields,
    )


CONSOLE_FIELDS = (
    "backend",
    "steps",
    "world_size",
    "effective_batch",
    "restarts",
    "first_loss",
    "final_loss",
    "compilations",
    "distinct_graphs",
    "unexpected_graphs",
    "tokens_per_second",
    "padding_fraction",
    "wall_seconds",
    "mfu",
)


def instance_type(recipe_groups: list[tuple[str, str | None]]) -> str | None:
    """The instance the run trained on, as far as it knows: NEURONTRAIN_INSTANCE_TYPE, SageMaker's
    SM_CURRENT_INSTANCE_TYPE, else the instance type of the recipe's trainium cluster group (role, type)."""
    for name in ("NEURONTRAIN_INSTANCE_TYPE", "SM_CURRENT_INSTANCE_TYPE"):
        if os.environ.get(name):
            return os.environ[name]
    return next((kind for role, kind in recipe_groups if role == "trainium" and kind), None)


def read_summary(output_dir: Path) -> RunSummary | None:
    path = Path(output_dir) / "summary.json"
    if not path.is_file():
        return None
    return RunSummary.from_json(json.loads(path.read_text()))


def field_descriptions() -> dict[str, str]:
    """Each RunSummary field's comment (`name: type  # description`), read from this module's source."""
    source = inspect.getsource(RunSummary)
    return dict(re.findall(r"^    (\w+): [^#\n]*#\s*(.+)$", source, re.MULTILINE))


def fields_table() -> str:
    """The Markdown table of summary.json's fields, as docs/outputs.md shows it."""
    docs = field_descriptions()
    rows = ["| field | meaning |", "|---|---|"]
    rows += [f"| `{f.name}` | {docs[f.name]} |" for f in dataclasses.fields(RunSummary)]
    return "\n".join(rows)
