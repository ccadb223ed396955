"""One Lightning fit under neurontrain: its plan (buckets and graph keys), the recompilation guard fed at every
sync the integration places, the counters for `summary.json`, and the progress-bar values kept on the device.

The strategy and the callback share one `Session`; neither imports the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from neurontrain.backends import Backend
from neurontrain.lightning import runtime
from neurontrain.lightning.padding import Padding, batch_rows, pad_batch, resize_batch, sequence_length
from neurontrain.logs import get_logger
from neurontrain.loop.guard import RecompilationGuard
from neurontrain.loop.summary import RunSummary, Throughput, build_summary

log = get_logger(__name__)


@dataclass
class Options:
    """What `trainer_args` was given."""

    buckets: str | list[int] = "auto"
    recompile_guard: str = "warn"
    preflight: bool = True
    output_dir: Path | None = None
    pad_values: dict[str, int | float] = field(default_factory=dict)
    pad_rows: bool = True
    expected_devices: int | None = None
    max_buckets: int = 6
    pad_to_multiple_of: int = 8
    compile_cache: Path = Path("compile_cache")


def planned_keys(buckets: list[int], accumulate: int, evaluates: bool) -> list[tuple]:
    """Graph keys of a fit: set-up, a micro-batch per bucket (the first of a window, whose gradients start
    from None, and with accumulation the others, which add to them), the optimizer step, eval per bucket."""
    keys: list[tuple] = [("setup",), ("optimizer",)] + ([("eval-epoch",)] if evaluates else [])
    for b in buckets:
        keys.append(("train", b))
        if accumulate > 1:
            keys.append(("train-accum", b))
        if evaluates:
            keys.append(("eval", b))
    return keys


@dataclass
class Session:
    options: Options
    backend: Backend
    padding: Padding | None = None
    bucket_mode: str = "fixed"
    keys: list[tuple] = field(default_factory=list)
    guard: RecompilationGuard | None = None
    step: int = 0
    shapes: dict = field(default_factory=dict)
    length: int | None = None
    real_tokens: int = 0
    slot_tokens: int = 0
    buckets_used: set = field(default_factory=set)
    losses: list = field(default_factory=list)
    step_losses: list = field(default_factory=list)  # data parallel: each step's loss over all workers (host)
    device_step_losses: list = field(default_factory=list)  # the same, reduced in the graph (read at the end)
    deferred: list = field(default_factory=list)  # (name, device tensor, metric) of progress-bar values this step
    deferred_values: dict | None = None  # their host values, once read this step
    stepped: bool = False  # whether this batch ended with an optimizer step
    accumulate: int = 1
    batch_size: int = 0
    started: float = 0.0
    counters_at_start: dict = field(default_factory=dict)
    train_steps_at_start: int = 0
    precompile: Any = None  # a PrecompileFit during `neurontrain precompile --lightning`
    eval_rows: int = 0  # rows an eval batch is padded to, once more than the train loader's batch size

    # -- plan -------------------------------------------------------------------------------------------------
    def start(self, buckets: list[int], mode: str, accumulate: int, evaluates: bool, rows: int | None) -> None:
        """The plan is fixed: buckets, keys, and the guard from here on (after the device checks)."""
        values = {**Padding([1]).pad_values, **self.options.pad_values}
        self.padding = Padding(buckets, values, rows if self.options.pad_rows else None)
        self.bucket_mode, self.accumulate, self.batch_size = mode, accumulate, rows or 0
        self.keys = planned_keys(buckets, accumulate, evaluates)
        backend = self.backend
        self.guard = RecompilationGuard(
            self.keys, self.options.recompile_guard, backend.compile_count, runtime.launches
        )
        self.started = time.perf_counter()
        self.counters_at_start = {
            "compiles": backend.compile_count(),
            "compile_seconds": backend.compile_seconds(),
            "host_reads": runtime.host_reads(),
        }
        log.info(f"lightning: buckets {buckets} ({mode}), {len(self.keys)} planned graphs")

    def plan_epoch_values(self) -> None:
        """The module logs values on_epoch in training: their epoch means are one more graph (`train-epoch`),
        planned when the first training batch has logged them, before any epoch ends."""
        key = ("train-epoch",)
        if key not in self.keys:
            self.keys.append(key)
            if self.guard is not None:
                self.guard.expected.add(key)

    # -- batches ----------------------------------------------------------------------------------------------
    def pad(self, batch: Any, training: bool, loader_rows: int | None = None) -> Any:
        """The host batch padded to its bucket; records its shapes for the guard and tokens for the summary.
        loader_rows: an eval batch's loader batch size (see `eval_padding`)."""
        if self.padding is None or not isinstance(batch, dict) and not hasattr(batch, "keys"):
            return batch
        length = sequence_length(batch)
        padding = self.padding if training else self.eval_padding(batch, loader_rows)
        target = self.precompile.target(training) if self.precompile is not None else None
        padded = pad_batch(batch, padding) if target is None else resize_batch(batch, target, padding)
        new_length = sequence_length(padded)
        self.length = new_length
        self.shapes = {k: list(v.shape) for k, v in padded.items() if isinstance(v, torch.Tensor)}
        if training and length is not None:
            self.buckets_used.add(new_length)
            mask = batch.get("attention_mask")
            rows = next(iter(self.shapes.values()))[0]
            self.real_tokens += int(mask.sum()) if isinstance(mask, torch.Tensor) else length * rows
            self.slot_tokens += rows * new_length
        return padded

    def eval_padding(self, batch: Any, loader_rows: int | None) -> Padding:
        """An eval batch's padding: rows up to the largest of the train loader's batch size, the eval loader's and
        any eval batch so far. An eval loader with bigger batches than the train loader's (its partial last batch
        padded to the train loader's size, measured: a second `eval` graph in the sanity check) then gives each
        eval bucket one shape."""
        padding = self.padding
        if padding is None or padding.rows is None:
            return padding
        self.eval_rows = max(padding.rows, loader_rows or 0, batch_rows(batch) or 0, self.eval_rows)
        return padding if self.eval_rows == padding.rows else replace(padding, rows=self.eval_rows)

    # -- syncs ------------------------------------------------------------------------------------------------
    def sync(self, kind: str) -> None:
        """Cut the pending graph of this kind of step and let the guard check what compiled."""
        key = (
            (kind,)
            if kind in ("setup", "optimizer", "eval-epoch", "train-epoch", "bookkeeping")
            else (kind, self.length)
        )
        if self.precompile is not None:
            launched = self.precompile.sync(key, self.shapes if len(key) > 1 else {}, runtime.sync)
        else:
            launched = runtime.sync()
        if self.guard is None:
            return
        self.guard.after_sync(key, self.step, self.shapes if len(key) > 1 else {}, syncs=launched)

    def record_loss(self, loss: Any) -> None:
        if isinstance(loss, dict):
            loss = loss.get("loss")
        if isinstance(loss, torch.Tensor):
            self.losses.append(loss.detach())

    # -- summary ----------------------------------------------------------------------------------------------
    def summary(self, steps: int, world: int = 1, restarts: int = 0, resumed_from: int | None = None) -> RunSummary:
        guard, backend, start = self.guard, self.backend, self.counters_at_start
        wall = time.perf_counter() - self.started
        if self.device_step_losses:  # one transfer for the whole fit
            self.step_losses += [float(v) for v in backend.to_host(self.device_step_losses)]
            self.device_step_losses = []
        if self.step_losses:
            losses = [self.step_losses[0], self.step_losses[-1]]
        elif self.losses:
            losses = [float(v) for v in self.backend.to_host(self.losses[:1] + self.losses[-1:])]
        else:
            losses = []
        padding = self.padding
        return build_summary(
            recipe="lightning",
            backend=backend.name,
            steps=steps,
            losses=losses,
            compile_counts=(
                backend.compile_count() - start["compiles"],
                backend.compile_seconds() - start["compile_seconds"],
            ),
            guard=guard,
            expected_graphs=len(self.keys),
            world=world,
            batch=self.batch_size,
            accum=self.accumulate,
            throughput=Throughput(real_tokens=self.real_tokens, slot_tokens=self.slot_tokens, wall_seconds=wall),
            resumed_from_step=resumed_from,
            checked_against_manifest=False,
            restarts=restarts,
            buckets=list(padding.buckets) if padding else [],
            bucket_mode=self.bucket_mode,
            buckets_used=sorted(self.buckets_used),
        )

    def host_reads(self) -> int:
        return runtime.host_reads() - self.counters_at_start.get("host_reads", 0)
