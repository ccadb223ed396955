"""What the loop records and shows as it goes: metrics.jsonl (one object per logged step), TensorBoard when it
is installed, and on rank 0 tqdm's progress bar."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from neurontrain.fileio import write_file_atomic
from neurontrain.logs import get_logger, is_rank_zero
from neurontrain.loop.mfu import FlopCount, Utilisation


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
            self.records = [r for r in _read_records(self.path) if r.get("step", 0) <= resume_step]
            write_file_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.records).encode())
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


def _read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, without a line torn by a kill."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _tensorboard_writer(path: Path) -> Any:
    try:
        import tensorboard  # noqa: F401  # lazy: optional dependency, which SummaryWriter needs
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path))


class StepLog:
    """The loop's per-step output, used as a context manager around the loop.

    A logged training step is one record: loss, learning rate, and since the previous logged step the real
    tokens a second and the padding share (over all workers), the compilations so far, the real tokens trained
    since step 1 (`tokens_seen`), the wall-clock time and, given the run's `utilisation`, the MFU of the interval
    (null where the device has no known peak). Token counts come in per micro-batch (`count`). On rank 0 tqdm's
    bar shows the steps (and the MFU where there is one), and the package's log lines are printed above it
    instead of through it.
    """

    def __init__(
        self,
        writer: MetricsWriter,
        *,
        total_steps: int,
        first_step: int,
        compilations: Callable[[], int],
        global_counts: Callable[[int, int], tuple[int, int]],
        utilisation: tuple[FlopCount, Utilisation] | None = None,
    ) -> None:
        """compilations: graphs compiled since the run started; global_counts: (real, slot) token counts summed
        over the workers (a collective); utilisation: FLOPs a token and the devices' peak, for MFU."""
        self.utilisation = utilisation
        self._flops = 0.0  # this worker's training FLOPs since the last logged step
        self.writer = writer
        self._bar_range = (total_steps, first_step)
        self._compilations = compilations
        self._global_counts = global_counts
        self._exit = contextlib.ExitStack()
        self._bar: tqdm | None = None
        self.real_tokens = self.slot_tokens = 0  # this worker's, over the run
        self.buckets: dict[int, list[int]] = {}  # this worker's, by bucket length
        self._since = time.perf_counter()
        self._real = self._slots = 0  # this worker's, since the last logged step
        seen = [r["tokens_seen"] for r in writer.records if "tokens_seen" in r]
        self.tokens_seen = seen[-1] if seen else 0  # real tokens of all workers, since step 1 (across resumes)

    def __enter__(self) -> StepLog:
        total, initial = self._bar_range
        disable = None if is_rank_zero() else True  # None: shown where stderr is a terminal
        bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, disable=disable, file=sys.stderr)
        self._bar = self._exit.enter_context(bar)
        if not bar.disable:  # log lines go above the bar rather than through it
            self._exit.enter_context(logging_redirect_tqdm(loggers=[get_logger()]))
        self._exit.callback(self.writer.close)
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit.close()

    @property
    def records(self) -> list[dict]:
        return self.writer.records

    def count(self, real: int, slots: int, length: int | None = None) -> None:
        """Real (non-padding) tokens and batch slots of one micro-batch of this worker, of bucket `length`."""
        if length is not None:
            counts = self.buckets.setdefault(length, [0, 0, 0])  # micro-batches, real tokens, slots
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + real, counts[2] + slots
            if self.utilisation is not None:
                self._flops += real * self.utilisation[0].per_token(length)
        self._real += real
        self._slots += slots
        self.real_tokens += real
        self.slot_tokens += slots

    def train(self, step: int, lr: float, loss: float) -> None:
        """Record a logged training step (its loss already on the host)."""
        now = time.perf_counter()
        seconds = max(now - self._since, 1e-9)
        real, slots = self._global_counts(self._real, self._slots)
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "tokens_per_second": real / seconds,
            "compilations": self._compilations(),
            "padding_fraction": 1.0 - real / max(slots, 1),
            "tokens_seen": self.tokens_seen + real,
            "time": round(time.time(), 3),
        }
        if self.utilisation is not None:  # every worker's rows share the step's length: its FLOPs a token
            flops = self._flops * real / self._real if self._real else 0.0
            record["mfu"] = self.utilisation[1].mfu(flops, seconds)
        self.tokens_seen += real
        self.writer.log(record)
        if self._bar is not None:
            mfu = {"mfu": f"{record['mfu']:.1%}"} if record.get("mfu") is not None else {}
            self._bar.set_postfix(loss=f"{loss:.4f}", **mfu, refresh=False)
        self._since, self._real, self._slots, self._flops = now, 0, 0, 0.0

    def record(self, record: dict[str, Any]) -> None:
        """Record anything else (an evaluation)."""
        self.writer.log(record)

    def advance(self) -> None:
        """One more step done."""
        if self._bar is not None:
            self._bar.update(1)
