"""Every private Lightning internal that neurontrain.lightning relies on, and nothing else: a Lightning release that
changes one of them fails the canary test (tests/unit/test_lightning_internals.py) instead of training wrongly.

Tested with Lightning 2.6 (the `lightning` extra pins that minor).

- `trainer.fit_loop._data_source.dataloader()`: the train DataLoader before the fit loop has loaded it (the
  sanity check's validation batches are padded already, so `buckets="auto"` is chosen before it runs).
- The train and validation loops' `_results` (`trainer.fit_loop.epoch_loop._results`, `...val_loop._results`)
  and each tensor `_ResultMetric`'s state names (torchmetrics `Metric._defaults`, also read on a logged
  torchmetrics object, `_ResultMetric.value`, and on the module's own torchmetrics objects): a metric registered
  by the first `self.log`, or reset after a validation run or an epoch (`default.clone()`), holds its states as
  pending references to device data, which the next sync would add to the step's graph as extra outputs (a
  graph variant on the first step and after every validation). `result_states` lists a logged tensor's; the
  strategy swaps each such reference for the data it refers to (`runtime.as_data`: no graph, no read). A
  torchmetrics object's (`torchmetrics_objects`) reset states are given fresh buffers from host copies of its
  `_defaults` instead: its `forward` reads the defaults in every step, and a state sharing a default's buffer
  would feed one buffer to the step's graph twice (another compiled module).
- `trainer._results` at the end of a validation or training epoch: each epoch-level `_ResultMetric`'s value (a
  logged tensor's mean, a logged torchmetrics object's `compute()`) is computed
  (`_ResultCollection._get_cache(metric, on_step=False)`, which caches it in `metric._computed`), synced as
  one graph, and `_computed` replaced by its host copy (one transfer): Lightning's own `.item()` for the bar
  and ModelCheckpoint's comparisons of the monitored value then run on the host instead of launching graphs.
- `trainer._results`: the active loop's `_ResultCollection`; its `valid_items()` yield `_ResultMetric`s whose
  `meta` (`_Metadata`: `prog_bar`, `on_step`, `forked_name(on_step)`) and `_forward_cache` (the step's value)
  are read here. Lightning converts every `prog_bar=True` value to a Python number after every batch
  (`_ResultCollection.metrics` -> `convert_tensors_to_scalars`), a blocking device->host read per metric per
  step even with the bar off. `defer_progress_bar_values` clears `meta.prog_bar` after the step, so that read
  does not happen, and `restore_progress_bar_flags` sets it back before the next `self.log` (which compares
  the stored `_Metadata` with the new one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torchmetrics

# (object path, attribute) pairs the canary test checks exist
PRIVATE_ATTRIBUTES = (
    ("lightning.pytorch.loops.fit_loop._FitLoop", "_data_source"),
    ("lightning.pytorch.trainer.connectors.data_connector._DataLoaderSource", "dataloader"),
    ("lightning.pytorch.trainer.trainer.Trainer", "_results"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result._ResultCollection", "valid_items"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result._ResultCollection", "metrics"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result._ResultMetric", "_forward_cache"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result._Metadata", "prog_bar"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result._Metadata", "forked_name"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result._ResultCollection", "_get_cache"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result._ResultMetric", "_computed"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result._ResultMetric", "is_tensor"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result._ResultMetric", "value"),
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "_results"),
    ("lightning.pytorch.loops.evaluation_loop._EvaluationLoop", "_results"),
    ("torchmetrics.Metric", "_defaults"),
)


def train_dataloader(trainer: Any) -> Any:
    """The train DataLoader as `fit` was given it (instance, module hook or datamodule hook)."""
    return trainer.fit_loop._data_source.dataloader()


def _results(trainer: Any) -> Any:
    return trainer._results


def defer_progress_bar_values(trainer: Any) -> list[tuple[str, Any, Any]]:
    """Clear `prog_bar` of this step's step-level progress-bar metrics; returns (name, value tensor, metric) of
    each: the bar reads the values when it redraws, `restore_progress_bar_flags` takes the metrics."""
    results = _results(trainer)
    if results is None:
        return []
    deferred = []
    for _, metric in results.valid_items():
        meta = metric.meta
        if meta.prog_bar and meta.on_step and metric._forward_cache is not None:
            meta.prog_bar = False
            deferred.append((meta.forked_name(True), metric._forward_cache, metric))
    return deferred


def restore_progress_bar_flags(deferred: list[tuple[str, Any, Any]]) -> None:
    """Set `prog_bar` back on the metrics `defer_progress_bar_values` cleared (before the next `self.log`)."""
    for _, _, metric in deferred:
        metric.meta.prog_bar = True


def epoch_values_to_host(trainer: Any, sync: Callable[[], None], to_host: Callable[[list], list]) -> None:
    """Compute the active loop's epoch-level metrics (logged tensors and torchmetrics objects), `sync()` them as
    one graph, and keep their host copies (one `to_host` transfer) as the values Lightning reads from here on."""
    results = _results(trainer)
    if results is None:
        return
    metrics = [m for _, m in results.valid_items() if m.meta.on_epoch]
    for metric in metrics:
        results._get_cache(metric, False)
    sync()
    metrics = [m for m in metrics if isinstance(m._computed, torch.Tensor) and m._computed.device.type != "cpu"]
    for metric, value in zip(metrics, to_host([m._computed for m in metrics]) if metrics else []):
        metric._computed = value


def logs_on_epoch(trainer: Any) -> bool:
    """Whether the active loop's results hold a metric logged with `on_epoch=True` (computed when its epoch ends)."""
    results = _results(trainer)
    return results is not None and any(m.meta.on_epoch for m in results.values())


def _loop_results(trainer: Any) -> list[Any]:
    epoch_loop = trainer.fit_loop.epoch_loop
    return [r for r in (epoch_loop._results, epoch_loop.val_loop._results) if r is not None]


def result_states(trainer: Any) -> list[tuple[Any, str, Any]]:
    """(metric, state name, tensor) of every tensor state of the train and validation loops' logged tensors."""
    out = []
    for results in _loop_results(trainer):
        for metric in results.values():
            if getattr(metric, "is_tensor", False):
                out += [(metric, k, getattr(metric, k)) for k in metric._defaults]
    return [(metric, k, v) for metric, k, v in out if isinstance(v, torch.Tensor)]


def torchmetrics_objects(trainer: Any, module: Any) -> list[Any]:
    """The torchmetrics objects the loops' results hold (`self.log` of a metric object) and the module's own."""
    found = {}
    for results in _loop_results(trainer):
        for metric in results.values():
            if not getattr(metric, "is_tensor", True) and isinstance(metric.value, torchmetrics.Metric):
                found[id(metric.value)] = metric.value
    for sub in module.modules():
        if isinstance(sub, torchmetrics.Metric):
            found[id(sub)] = sub
    return list(found.values())
