"""`summary.json`: the one definition of what a run reports when it ends.

The trainer fills a `RunSummary`; `run` adds the cache counters, prints `CONSOLE_FIELDS` as one JSON line
and writes the whole summary atomically. The README's table of fields is `fields_table()` (a test checks
that the two agree).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neurontrain.fileio import write_file_atomic

_REQUIRED = object()


def _doc(text: str, default: Any = _REQUIRED, factory: Any = None) -> Any:
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": text})
    if default is _REQUIRED:
        return field(metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass(kw_only=True)
class RunSummary:
    recipe: str = _doc("recipe name")
    backend: str = _doc("backend the run used (neuron, xla-cpu, xla-cuda, eager)")
    steps: int = _doc("optimizer steps of the run (train.max_steps)")
    resumed_from_step: int | None = _doc(
        "step of the checkpoint the run resumed from; null for a fresh run", default=None
    )
    first_loss: float | None = _doc("training loss of the first logged step", default=None)
    final_loss: float | None = _doc("training loss of the last logged step", default=None)
    compilations: int = _doc("graphs compiled during the run (the backend's own counter)")
    compile_seconds: float = _doc("seconds spent compiling them")
    distinct_graphs: int = _doc("distinct graph keys (step kind, shape) the run executed")
    expected_graphs: int = _doc("graph keys the plan expected")
    unexpected_graphs: int = _doc("graphs the plan did not expect (each also a recompilation-guard report)")
    unexpected: list[dict] = _doc("details of each unexpected graph: key, step, shapes, reason", factory=list)
    hidden_host_syncs: int = _doc("device-to-host reads inside a step (.item(), print(tensor), ...)")
    checked_against_manifest: bool = _doc("whether compiled graphs were checked against a precompile manifest")
    world_size: int = _doc("data-parallel workers")
    per_worker_batch: int = _doc("rows per micro-batch on each worker")
    grad_accum: int = _doc("micro-batches per optimizer step")
    effective_batch: int = _doc("rows per optimizer step over all workers")
    restarts: int = _doc("times the workers were restarted after a failure (torchrun elastic)")
    buckets: list[int] = _doc("planned sequence-length buckets", factory=list)
    bucket_mode: str = _doc("how the buckets were chosen: fixed or auto (cost model)")
    buckets_used: list[int] = _doc("buckets that training batches actually used", factory=list)
    tokens_per_second: float = _doc("real (non-padding) training tokens a second, all workers")
    padding_fraction: float = _doc("share of batch slots that were padding")
    wall_seconds: float = _doc("seconds from set-up to the end of the loop")
    eval_loss: float | None = _doc("loss of the last evaluation, when the recipe evaluates", default=None)
    eval_accuracy: float | None = _doc("accuracy of the last evaluation (sequence classification)", default=None)
    compile_cache: dict | None = _doc(
        "what run pulled from and pushed to the compile cache, when it moved anything", default=None
    )
    neuron_cache: dict | None = _doc(
        "on Neuron: runtime cache root, modules compiled at run time, cache hits", default=None
    )

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
)


def read_summary(output_dir: Path) -> RunSummary | None:
    path = Path(output_dir) / "summary.json"
    if not path.is_file():
        return None
    return RunSummary.from_json(json.loads(path.read_text()))


def fields_table() -> str:
    """The Markdown table of summary.json's fields, as the README shows it."""
    rows = ["| field | meaning |", "|---|---|"]
    rows += [f"| `{f.name}` | {f.metadata['doc']} |" for f in dataclasses.fields(RunSummary)]
    return "\n".join(rows)
