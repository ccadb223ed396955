"""metrics.jsonl (one object per logged step), summary.json, and TensorBoard when it is installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, output_dir: Path, resume_step: int | None, write: bool = True) -> None:
        """write=False (workers other than 0): records are kept in memory only."""
        self.path = output_dir / "metrics.jsonl"
        self.records: list[dict] = []
        self._fh = self._tb = None
        if not write:
            return
        if resume_step is not None and self.path.exists():
            # A killed run may have logged steps past its last checkpoint: those steps run again.
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("step", 0) <= resume_step:
                    kept.append(rec)
            self.records = kept
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif self.path.exists():
            self.path.unlink()
        self._fh = open(self.path, "a")
        self._tb = _tensorboard_writer(output_dir / "tensorboard")

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._fh is None:
            return
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._fh is None:
            return
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def _tensorboard_writer(path: Path):
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path))


def write_summary(output_dir: Path, summary: dict) -> None:
    tmp = output_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    tmp.replace(output_dir / "summary.json")
