"""Canary: every private Lightning internal neurontrain.lightning relies on (listed in one module) still exists
in the installed Lightning. A release that renames one fails here, not in a training run."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

import lightning
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultCollection, _ResultMetric

from neurontrain.lightning import internals


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _has(cls: type, attribute: str) -> bool:
    """A class attribute, a dataclass field, or an instance attribute its (or a base's) source assigns."""
    if hasattr(cls, attribute) or (
        dataclasses.is_dataclass(cls) and attribute in {f.name for f in dataclasses.fields(cls)}
    ):
        return True
    sources = [inspect.getsource(c) for c in cls.__mro__ if c.__module__.split(".")[0] in ("lightning", "torchmetrics")]
    return any(re.search(rf"self\.{attribute}\s*(:[^=]*)?=", source) for source in sources)


def test_every_private_attribute_exists():
    missing = [f"{o}.{a}" for o, a in internals.PRIVATE_ATTRIBUTES if not _has(_resolve(o), a)]
    assert not missing, f"Lightning {lightning.__version__} lacks {missing}"
    # control: the check finds an attribute that does not exist
    assert not _has(_ResultCollection, "no_such_internal") and not _has(_ResultMetric, "_no_such_cache")


def test_progress_bar_deferral_round_trip_on_a_real_result_collection():
    """`self.log(prog_bar=True)`'s metric: deferral clears prog_bar so `metrics()` converts nothing, restore
    sets it back so the next `self.log` (which compares metadata) is accepted."""
    results = _ResultCollection(training=True)
    results.log("training_step", "loss", torch.tensor(2.5), prog_bar=True, on_step=True, on_epoch=False)
    assert results.metrics(True)["pbar"] == {"loss": 2.5}  # control: Lightning converts it
    trainer = type("T", (), {"_results": results})()
    deferred = internals.defer_progress_bar_values(trainer)
    assert [(name, float(value)) for name, value, _ in deferred] == [("loss", 2.5)]
    assert results.metrics(True)["pbar"] == {}
    internals.restore_progress_bar_flags(deferred)
    results.log("training_step", "loss", torch.tensor(1.5), prog_bar=True, on_step=True, on_epoch=False)
    assert results.metrics(True)["pbar"] == {"loss": 1.5}
    metric = next(iter(results.values()))
    assert isinstance(metric, _ResultMetric) and isinstance(metric.meta, _Metadata)
    assert set(metric._defaults) >= {"value"}


def _trainer_with(results: _ResultCollection):
    from types import SimpleNamespace

    epoch_loop = SimpleNamespace(_results=results, val_loop=SimpleNamespace(_results=None))
    return SimpleNamespace(_results=results, fit_loop=SimpleNamespace(epoch_loop=epoch_loop))


def test_logged_tensors_and_torchmetrics_objects_are_found_and_their_epoch_values_computed():
    """What the strategy settles before a step (a logged tensor's states; every torchmetrics object, logged or
    the module's own, once each) and what an epoch's end computes (tensors and torchmetrics objects alike)."""
    import torchmetrics

    results = _ResultCollection(training=True)
    module = torch.nn.Module()
    module.acc, module.unlogged = torchmetrics.MeanMetric(), torchmetrics.SumMetric()
    module.acc.update(torch.tensor([1.0, 3.0]))
    results.log("training_step", "loss", torch.tensor(2.0), on_step=True, on_epoch=True, batch_size=4)
    results.log("training_step", "acc", module.acc, on_step=False, on_epoch=True)
    trainer = _trainer_with(results)
    states = {(type(m).__name__, name) for m, name, _ in internals.result_states(trainer)}
    assert states == {("_ResultMetric", "value"), ("_ResultMetric", "cumulated_batch_size")}
    objects = internals.torchmetrics_objects(trainer, module)
    assert len(objects) == 2 and module.acc in objects and module.unlogged in objects
    assert internals.logs_on_epoch(trainer)
    synced = []
    internals.epoch_values_to_host(trainer, lambda: synced.append(True), lambda tensors: tensors)
    assert synced == [True]
    computed = sorted(float(m._computed) for m in results.values())
    assert computed == [2.0, 2.0]  # the loss's mean over its batch, the metric's compute()
    # control: a collection logged on step only has no epoch values
    step_only = _ResultCollection(training=True)
    step_only.log("training_step", "loss", torch.tensor(2.0), on_step=True, on_epoch=False)
    assert not internals.logs_on_epoch(_trainer_with(step_only))
