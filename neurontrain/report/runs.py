"""A run's own files, read back: summary.json, metrics.jsonl, preflight.jsonl and its checkpoints' meta.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neurontrain.errors import UsageError


@dataclass
class RunFiles:
    name: str  # how the page and the comparison name the run (its directory name, made unique)
    path: Path
    summary: dict[str, Any]
    records: list[dict] = field(default_factory=list)  # metrics.jsonl, in order
    preflight: list[dict] = field(default_factory=list)  # preflight.jsonl: one record per (re)start
    checkpoints: list[dict] = field(default_factory=list)  # meta.json of each complete checkpoint

    @property
    def train(self) -> list[dict]:
        return [r for r in self.records if "loss" in r]

    @property
    def evals(self) -> list[dict]:
        return [r for r in self.records if any(k.startswith("eval_") for k in r)]


def load_run(path: Path, name: str | None = None) -> RunFiles:
    """Read a run directory; exit 2 (UsageError) when it is not one."""
    path = Path(path)
    summary_path = path / "summary.json"
    if not summary_path.is_file():
        raise UsageError(f"{path}: no summary.json (not a finished run's --output-dir)")
    try:
        summary = json.loads(summary_path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"{summary_path}: not JSON ({exc})") from None
    checkpoints = []
    for meta in sorted((path / "checkpoints").glob("step_*/meta.json")):
        if (meta.parent / "COMPLETE").exists():
            checkpoints.append(json.loads(meta.read_text()))
    return RunFiles(
        name=name or path.resolve().name,
        path=path,
        summary=summary,
        records=_jsonl(path / "metrics.jsonl"),
        preflight=_jsonl(path / "preflight.jsonl"),
        checkpoints=checkpoints,
    )


def load_runs(paths: list[Path]) -> list[RunFiles]:
    """Several runs, each named by its directory (with its parent's name too when two share a name)."""
    names = [Path(p).resolve().name for p in paths]
    runs = []
    for path, name in zip(paths, names):
        if names.count(name) > 1:
            name = f"{Path(path).resolve().parent.name}/{name}"
        runs.append(load_run(Path(path), name))
    return runs


def _jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file, without a line torn by a kill; [] when there is no file."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
