"""summary.json has one definition (RunSummary); the README's table of its fields is generated from it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from neurontrain.loop.summary import CONSOLE_FIELDS, RunSummary, fields_table, read_summary

README = Path(__file__).resolve().parents[2] / "docs" / "outputs.md"


def _summary(**changes) -> RunSummary:
    base = dict(
        recipe="r",
        backend="xla-cpu",
        steps=3,
        compilations=3,
        compile_seconds=1.5,
        distinct_graphs=3,
        expected_graphs=3,
        unexpected_graphs=0,
        hidden_host_syncs=0,
        checked_against_manifest=False,
        world_size=1,
        per_worker_batch=8,
        grad_accum=1,
        effective_batch=8,
        restarts=0,
        bucket_mode="fixed",
        tokens_per_second=10.0,
        padding_fraction=0.5,
        wall_seconds=2.0,
    )
    return RunSummary(**{**base, **changes})


def test_the_outputs_page_table_is_the_generated_one():
    text = README.read_text()
    block = re.search(r"<!-- summary-fields:start -->\n(.*?)\n<!-- summary-fields:end -->", text, re.S)
    assert block, "docs/outputs.md lacks the summary-fields block"
    stale = "docs/outputs.md's summary.json table is stale: regenerate it from fields_table()"
    assert block.group(1) == fields_table(), stale


def test_summary_round_trips_and_is_written_atomically(tmp_path):
    summary = _summary(eval_loss=0.25, buckets=[64, 128])
    summary.write(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name != "summary.json"], "a temporary file was left behind"
    assert json.loads((tmp_path / "summary.json").read_text())["eval_loss"] == 0.25
    assert read_summary(tmp_path) == summary
    assert list(summary.console()) == list(CONSOLE_FIELDS)


def test_a_summary_needs_its_required_fields_by_keyword():
    with pytest.raises(TypeError):
        RunSummary(recipe="r")
    with pytest.raises(TypeError):
        RunSummary("r", "xla-cpu")  # keyword-only
