"""The pure parts of `precompile --lightning`: which bucket each batch visits, batches cut or padded to it,
torch-xla's dump read back, graphs named by the sync windows they fall in, and the script spec's errors."""

from __future__ import annotations

import pytest
import torch

from neurontrain.compile.graphs import graph_id
from neurontrain.compile.xla_dump import dump_file, parse_dump
from neurontrain.errors import UsageError
from neurontrain.lightning.padding import Padding, resize_batch
from neurontrain.lightning.precompile import call_build, load_build
from neurontrain.lightning.precompile_plan import Visits, Window, fit_graphs

DUMP = b"""[ScheduleSyncTensorsGraph]
TensorsGraphInfo:
  sync (/venv/site-packages/torch_xla/torch_xla.py:87)
  matmul (/repo/neurontrain/health/worker.py:82)
  <module> (/repo/x.py:6)

Root Hashes: (8758de5b)

## BEGIN_GRAPH
HloModule IrToHlo.10, entry_computation_layout={()->(f32[3]{0})}

ENTRY %IrToHlo.10 () -> (f32[3]) {
  ROOT %c = f32[3] constant({1, 2, 3})
}


Graph Hash: 72db6a0d

## END_GRAPH

[ScheduleSyncTensorsGraph]
TensorsGraphInfo:
  sync (/venv/site-packages/torch_xla/torch_xla.py:87)

Root Hashes: (63983b6a)

## BEGIN_GRAPH
HloModule IrToHlo.8, entry_computation_layout={()->(f32[3]{0})}

ENTRY %IrToHlo.8 () -> (f32[3]) {
  ROOT %c = f32[3] constant({4, 5, 6})
}


Graph Hash: b7678ee6

## END_GRAPH
"""


def test_visits_give_each_bucket_a_whole_window_and_eval_batches_take_turns():
    visits = Visits([16, 32, 64], accumulate=2)
    assert visits.steps == 3
    assert [visits.train_target() for _ in range(6)] == [16, 16, 32, 32, 64, 64]
    assert [visits.eval_target() for _ in range(5)] == [16, 32, 64, 16, 32]


def test_resize_cuts_a_longer_batch_and_pads_a_shorter_one_and_its_rows():
    batch = {
        "input_ids": torch.arange(30).reshape(3, 10),
        "attention_mask": torch.ones(3, 10, dtype=torch.long),
        "labels": torch.arange(30).reshape(3, 10),
        "class_label": torch.tensor([1, 0, 1]),
    }
    padding = Padding([8, 16], {"input_ids": 0, "attention_mask": 0, "labels": -100}, rows=4)
    cut = resize_batch(batch, 8, padding)
    assert cut["input_ids"].shape == (4, 8) and torch.equal(cut["input_ids"][:3], batch["input_ids"][:, :8])
    assert cut["class_label"].shape == (4,)
    longer = resize_batch(batch, 16, padding)
    assert longer["labels"].shape == (4, 16) and (longer["labels"][:3, 10:] == -100).all()
    assert (longer["attention_mask"][:3, 10:] == 0).all() and torch.equal(
        longer["input_ids"][:3, :10], batch["input_ids"]
    )


def test_the_dump_is_read_back_block_by_block_with_its_callers(tmp_path):
    blocks = parse_dump(DUMP)
    assert [b.xla_hash for b in blocks] == ["72db6a0d", "b7678ee6"]
    assert blocks[0].hlo.startswith("HloModule IrToHlo.10") and blocks[0].hlo.rstrip().endswith("}")
    assert blocks[0].caller() == "matmul (/repo/neurontrain/health/worker.py:82)"
    assert blocks[1].offset > blocks[0].offset
    (tmp_path / "graphs.0").write_bytes(DUMP)  # torch-xla appends the device ordinal to the name it is given
    assert dump_file(tmp_path / "graphs") == tmp_path / "graphs.0"
    assert dump_file(tmp_path / "other") is None


def test_graphs_are_named_by_the_window_they_fall_in_and_kept_once():
    first, second = parse_dump(DUMP)
    twice = parse_dump(DUMP + DUMP)  # the same two graphs cut again later
    split = twice[2].offset
    windows = [
        Window(0, second.offset, None, ["neuronxcc-2/MODULE_1+a"]),
        Window(second.offset, split, ("train", 32), ["neuronxcc-2/MODULE_2+a"], {"input_ids": [8, 32]}),
        Window(split, None, ("eval", 32)),
    ]
    graphs = fit_graphs(twice, windows)
    assert [g.key for g in graphs] == [("other", first.caller()), ("train", 32)]
    assert graphs[0].modules == ("neuronxcc-2/MODULE_1+a",) and graphs[1].shapes == {"input_ids": [8, 32]}
    assert graphs[1].graph_id == graph_id(second.hlo) != graphs[0].graph_id


def test_the_script_spec_errors_are_one_line_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="SCRIPT:FUNCTION"):
        load_build("train.py")
    with pytest.raises(UsageError, match="not a Python script"):
        load_build(f"{tmp_path / 'missing.py'}:build")
    script = tmp_path / "user_script.py"
    script.write_text("def build():\n    return 1, 2\n\ndef takes(argv):\n    return None, None, {}\n")
    with pytest.raises(UsageError, match="has no function nope"):
        load_build(f"{script}:nope")
    function, argv, path, name = load_build(f"{script}:build --max-steps 3")
    assert (argv, path, name) == (["--max-steps", "3"], script, "build")
    with pytest.raises(UsageError, match="takes no arguments"):
        call_build(function, argv)
    with pytest.raises(UsageError, match="must return"):
        call_build(function, [])
    takes, _, _, _ = load_build(f"{script}:takes")
    with pytest.raises(UsageError, match="do not include neurontrain.lightning.trainer_args"):
        call_build(takes, [])
