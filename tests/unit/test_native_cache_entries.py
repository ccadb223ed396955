"""The native backend's cache entry: its name, its sha256 record, and what run refuses to load (pure logic and
files; the compile and the loading into PyTorch's caches are in tests/integration/test_native_cache.py)."""

import json
from collections import Counter

import pytest
from conftest import RECIPES

from neurontrain.compile.native_cache import (
    ARTIFACTS,
    META,
    cache_counts,
    entry_problem,
    load_entry,
    native_entry_key,
    native_entry_path,
    write_entry,
)
from neurontrain.compile.store import ENTRY_RECORD, local_entries, valid_entry_path, verify_local
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe

KEY_FIELDS = ("0123456789abcdef", "2.9.0+cpu", "cpu", "inductor", "x86_64")
SMALL = ["train.max_steps=4", "train.schedule.warmup_steps=1", "data.train_samples=64", "data.eval_samples=8"]


def test_the_entry_key_is_stable_and_changes_with_each_field():
    key = native_entry_key(*KEY_FIELDS)
    assert key == native_entry_key(*KEY_FIELDS) and len(key) == 16
    for i in range(len(KEY_FIELDS)):
        changed = list(KEY_FIELDS)
        changed[i] += "-other"
        assert native_entry_key(*changed) != key, KEY_FIELDS[i]


def test_the_entry_path_follows_the_plan():
    recipe = load_recipe(RECIPES / "tiny-llama-clm.yaml", SMALL)
    path = native_entry_path(make_plan(recipe, "native"), "cpu", "inductor")
    assert path.startswith("native/tiny-llama-clm-") and valid_entry_path(path)
    assert native_entry_path(make_plan(recipe, "native"), "cpu", "inductor") == path
    longer = load_recipe(RECIPES / "tiny-llama-clm.yaml", [*SMALL, "train.max_steps=5"])
    assert native_entry_path(make_plan(longer, "native"), "cpu", "inductor") != path
    assert native_entry_path(make_plan(recipe, "native"), "neuron", "neuron") != path


def test_cache_counts_reads_the_counters_and_defaults_to_zero():
    counters = {"aot_autograd": Counter(autograd_cache_hit=2), "inductor": Counter(fxgraph_cache_miss=3)}
    counts = cache_counts(counters)
    assert counts["autograd_cache_hit"] == 2 and counts["fxgraph_cache_miss"] == 3
    assert counts["autograd_cache_miss"] == counts["fxgraph_cache_hit"] == 0


@pytest.fixture
def entry(tmp_path):
    path = "native/tiny-0123456789abcdef"
    write_entry(tmp_path, path, b"artifact bytes" * 100, {"graphs": [["train", 64]]})
    return tmp_path, path


def test_a_written_entry_is_listed_recorded_and_verified(entry):
    root, path = entry
    assert entry_problem(root / path) is None
    assert list(local_entries(root)) == [path]
    record = json.loads((root / path / ENTRY_RECORD).read_text())
    assert sorted(record["files"]) == [ARTIFACTS, META] and record["path"] == path
    assert verify_local(root) == []
    assert not list((root / "native").glob(".write-*"))  # the staging directory was renamed into place


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda d: (d / ARTIFACTS).write_bytes(b"Artifact bytes" * 100), "artifacts.bin altered (sha256 mismatch)"),
        (lambda d: (d / ARTIFACTS).write_bytes(b"artifact bytes"), "artifacts.bin truncated or extended (14 of 1400"),
        (lambda d: (d / ENTRY_RECORD).unlink(), "no sha256 record"),
        (lambda d: (d / ENTRY_RECORD).write_text("{"), "unreadable sha256 record"),
        (lambda d: (d / META).unlink(), "entry.json missing"),
    ],
)
def test_a_damaged_entry_is_refused_and_not_loaded(entry, damage, problem):
    root, path = entry
    damage(root / path)
    assert entry_problem(root / path).startswith(problem)
    load = load_entry(root, path)  # refused before PyTorch sees any byte
    assert (load.loaded, load.artifacts) == (False, 0) and load.refused.startswith(problem)


def test_a_missing_entry_loads_nothing_and_refuses_nothing(tmp_path):
    load = load_entry(tmp_path, "native/tiny-0123456789abcdef")
    assert load.to_json() == {
        "entry": "native/tiny-0123456789abcdef",
        "loaded": False,
        "refused": None,
        "artifacts": 0,
    }


def test_cache_verify_reports_an_altered_native_entry(entry):
    root, path = entry
    (root / path / ARTIFACTS).write_bytes(b"Artifact bytes" * 100)
    assert verify_local(root) == [{"entry": path, "file": ARTIFACTS, "problem": "altered (sha256 mismatch)"}]
