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
