"""neurontrain.lightning's pure logic: host padding of dict batches to buckets, bucket choice, planned keys, the
one-line errors of `trainer_args` (no torch-xla runtime: nothing here starts one)."""

from __future__ import annotations

import sys

import pytest
import torch

from neurontrain.errors import UsageError
from neurontrain.lightning.args import check_not_mixed, trainer_args
from neurontrain.lightning.padding import IGNORE_INDEX, Padding, auto_buckets, check_buckets, pad_batch, target_length
from neurontrain.lightning.plan import eval_loader_rows, loader_lengths
from neurontrain.lightning.session import Options, Session, planned_keys


def _batch(rows: int, length: int) -> dict:
    return {
        "input_ids": torch.arange(rows * length).reshape(rows, length) + 1,
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "labels": torch.arange(rows * length).reshape(rows, length),
        "score": torch.ones(rows),  # one value per row: no sequence dimension
    }


def test_a_batch_pads_to_its_bucket_with_each_keys_pad_value():
    batch = _batch(2, 5)
    padded = pad_batch(batch, Padding([4, 8, 16], {"input_ids": 7, "attention_mask": 0, "labels": IGNORE_INDEX}))
    assert {k: list(v.shape) for k, v in padded.items()} == {
        "input_ids": [2, 8],
        "attention_mask": [2, 8],
        "labels": [2, 8],
        "score": [2],
    }
    assert torch.equal(padded["input_ids"][:, :5], batch["input_ids"])  # the real part is unchanged
    assert (padded["input_ids"][:, 5:] == 7).all()
    assert (padded["attention_mask"][:, 5:] == 0).all() and (padded["labels"][:, 5:] == IGNORE_INDEX).all()
    # control: a batch already at a bucket is left as it is
    same = pad_batch(_batch(2, 8), Padding([8]))
    assert torch.equal(same["input_ids"], _batch(2, 8)["input_ids"])


def test_a_partial_batch_gets_neutral_rows_and_other_batches_pass_through():
    padded = pad_batch(_batch(3, 4), Padding([4], rows=8))
    assert padded["input_ids"].shape == (8, 4) and padded["score"].shape == (8,)
    assert (padded["labels"][3:] == IGNORE_INDEX).all() and (padded["attention_mask"][3:] == 0).all()
    assert pad_batch([torch.ones(2, 3)], Padding([8]))[0].shape == (2, 3)  # not a mapping: unchanged


def test_a_batch_longer_than_every_bucket_keeps_its_length_for_the_guard_to_name():
    assert target_length(20, [8, 16]) == 20
    assert pad_batch(_batch(1, 20), Padding([8, 16]))["input_ids"].shape == (1, 20)
    assert target_length(9, [8, 16]) == 16 and target_length(8, [8, 16]) == 8


def test_eval_batches_pad_to_the_largest_of_the_loaders_batch_sizes():
    """Validation batches of 16 rows (train 8): its partial batch of 8 pads to 16, not to the train loader's 8;
    train batches keep the train loader's rows."""
    session = Session(Options(), backend=None)
    session.padding = Padding([8], rows=8)
    shapes = []
    for rows, training, loader_rows in ((16, False, 16), (8, False, 16), (3, False, None), (5, True, None)):
        padded = session.pad(_batch(rows, 5), training, loader_rows)
        shapes.append(list(padded["input_ids"].shape))
    assert shapes == [[16, 8], [16, 8], [16, 8], [8, 8]]
    session.padding = Padding([8], rows=None)  # pad_rows=False: rows stay as they come
    assert list(session.pad(_batch(3, 5), False, 16)["input_ids"].shape) == [3, 8]


def test_eval_loader_rows_from_lightnings_public_loaders():
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=4)
    trainer = type("T", (), {"testing": False, "predicting": False, "val_dataloaders": [loader, object()]})()
    assert eval_loader_rows(trainer, 0) == 4 and eval_loader_rows(trainer, 1) is None
    assert eval_loader_rows(trainer, 5) is None
    trainer.val_dataloaders = loader
    assert eval_loader_rows(trainer) == 4


def test_auto_buckets_follow_the_cost_model():
    short_and_long = [12] * 90 + [120] * 10
    few = auto_buckets(short_and_long, batch_size=8, n_params=10_000, planned_batches=2, graphs_per_bucket=2)
    many = auto_buckets(short_and_long, batch_size=64, n_params=50_000_000, planned_batches=5000, graphs_per_bucket=2)
    # few steps: one more compile costs more than padding saves; many steps of a big model: the short bucket pays
    assert few == [120]
    assert many == [16, 120]
    with pytest.raises(UsageError):
        auto_buckets([], batch_size=8, n_params=1, planned_batches=1, graphs_per_bucket=1)


def test_explicit_buckets_and_planned_keys():
    assert check_buckets([32, 16, 32]) == [16, 32]
    with pytest.raises(UsageError):
        check_buckets([0, 16])
    keys = planned_keys([16, 32], accumulate=2, evaluates=True)
    assert sorted(keys) == sorted(
        [("setup",), ("optimizer",), ("eval-epoch",)]
        + [(k, b) for b in (16, 32) for k in ("train", "train-accum", "eval")]
    )
    assert ("train-accum", 16) not in planned_keys([16], accumulate=1, evaluates=False)


def test_loader_lengths_reads_each_batch_once():
    lengths, rows = loader_lengths([_batch(4, 5), _batch(3, 9), [torch.ones(2)]])
    assert lengths == [5, 9] and rows == 4


def test_trainer_args_refuses_bad_input_in_one_line(monkeypatch):
    with pytest.raises(UsageError, match="recompile_guard"):
        trainer_args(recompile_guard="sometimes")
    with pytest.raises(UsageError, match="buckets"):
        trainer_args(buckets="max")
    check_not_mixed()  # control: no pytorch_lightning in this process
    monkeypatch.setitem(sys.modules, "pytorch_lightning", object())
    with pytest.raises(UsageError, match="pytorch_lightning") as err:
        trainer_args()
    assert "\n" not in str(err.value)
