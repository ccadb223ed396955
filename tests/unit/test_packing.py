"""Sequence packing without torch-xla: which samples share a row, the batch order over packed rows, their
collation, and the plan's decision (data.packing off / on / auto)."""

import random
from collections import Counter

import pytest
import torch
from conftest import RECIPES

from neurontrain.data.batching import Batcher, fixed_batches
from neurontrain.data.buckets import StepCostModel, bucketing_seconds
from neurontrain.data.collate import IGNORE_INDEX, Collator
from neurontrain.data.packing import Packing, pack_rows, packed_padding_fraction
from neurontrain.data.sharding import worker_rows
from neurontrain.errors import UsageError
from neurontrain.model.inputs import ModelInputs
from neurontrain.plan.packing import docs_limit, estimate_packing, packing_refusal
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe


def _review_lengths(n: int = 600, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [max(2, min(256, int(rng.lognormvariate(3.4, 0.7)))) for _ in range(n)]


def test_rows_hold_every_sample_once_within_the_row_and_document_limits():
    lengths = _review_lengths()
    for max_docs in (None, 3):
        rows = pack_rows(lengths, range(len(lengths)), Packing(256, max_docs))
        assert Counter(i for row in rows for i in row) == Counter(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= 256 for row in rows)
        if max_docs:
            assert max(len(row) for row in rows) == max_docs
    assert packed_padding_fraction(lengths, pack_rows(lengths, range(len(lengths)), Packing(256)), 256) < 0.02


def test_best_fit_puts_a_sample_into_the_fullest_row_it_fits():
    # longest first: 60 opens row 0 (40 free), 50 opens row 1 (50 free), 45 goes to row 1 (5 free), 40 fills
    # row 0, and 5 fills row 1
    rows = pack_rows([40, 50, 60, 45, 5], range(5), Packing(100))
    assert rows == [(2, 0), (1, 3, 4)]


def test_samples_longer_than_the_row_take_a_row_of_their_own():
    rows = pack_rows([300, 10, 20], range(3), Packing(128))
    assert rows == [(0,), (2, 1)]


def test_packed_batches_are_deterministic_resumable_and_reshuffled_each_epoch():
    lengths = tuple(_review_lengths(300))
    batcher = Batcher(lengths, 4, None, True, 7, True, 8, Packing(256))
    stream = [b for _, b in zip(range(40), batcher.iterate(0))]
    assert stream == [b for _, b in zip(range(40), batcher.iterate(0))]
    assert [b for _, b in zip(range(15), batcher.iterate(25))] == stream[25:40]
    assert batcher.epoch(0) != batcher.epoch(1)
    for batch in batcher.epoch(0):
        assert batch.length == 256 and len(batch.rows) == 4 and len(batch.units) == 4
        assert batch.indices == tuple(i for row in batch.rows for i in row)
    epoch = batcher.epoch(0)
    assert len({i for b in epoch for i in b.indices}) > 0.9 * len(lengths)  # drop_last drops a partial batch only


def test_packed_eval_batches_cover_every_sample_once_and_keep_the_partial_batch():
    lengths = _review_lengths(101)
    batches = fixed_batches(lengths, 3, None, packing=Packing(256, 8))
    assert sorted(i for b in batches for i in b.indices) == list(range(101))
    assert all(len(b.rows) == 3 for b in batches[:-1]) and 1 <= len(batches[-1].rows) <= 3


def test_workers_split_a_packed_batch_by_rows():
    batch = Batcher(tuple(_review_lengths(200)), 6, None, True, 0, True, 8, Packing(256)).epoch(0)[0]
    parts = [worker_rows(batch.rows, rank, 3) for rank in range(3)]
    assert sorted(row for part in parts for row in part) == sorted(batch.rows)
    assert all(len(part) == 2 for part in parts)


def _packed_batch(task: str, max_docs: int | None = None):
    ids = [[11, 12, 13], [21, 22], [31, 32, 33, 34], [41]]
    batch = fixed_batches([3, 2, 4, 1], 2, None, packing=Packing(6, max_docs))[0]
    return batch, Collator(ids, [1, 0, 1, 0], task, 2, 0, max_docs=max_docs)(batch)


def test_packed_causal_lm_collation_restarts_positions_and_never_labels_across_documents():
    batch, out = _packed_batch("causal-lm")
    assert batch.rows == ((2, 1), (0, 3))
    assert out["input_ids"].tolist() == [[31, 32, 33, 34, 21, 22], [11, 12, 13, 41, 0, 0]]
    assert out["document_ids"].tolist() == [[1, 1, 1, 1, 2, 2], [1, 1, 1, 2, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 0]]
    no = IGNORE_INDEX
    assert out["labels"].tolist() == [[no, 32, 33, 34, no, 22], [no, 12, 13, no, no, no]]
    assert (out["real_tokens"], out["loss_items"]) == (10, 3 + 1 + 2 + 0)


def test_packed_classification_collation_has_a_label_and_first_token_per_document_slot():
    _, out = _packed_batch("sequence-classification", max_docs=3)
    no = IGNORE_INDEX
    assert out["labels"].tolist() == [[1, 0, no], [1, 0, no]]
    assert out["cls_positions"].tolist() == [[0, 4, 0], [0, 3, 0]]
    assert out["loss_items"] == 4
    with pytest.raises(ValueError, match="more than max_docs 1"):
        Collator([[1, 2], [3]], [0, 1], "sequence-classification", 1, 0, max_docs=1)(
            fixed_batches([2, 1], 1, None, packing=Packing(4))[0]
        )


def test_packing_estimate_counts_fewer_steps_for_the_same_samples():
    lengths = _review_lengths()
    cost = StepCostModel(5.0, 3.2e10, 0.02, 2e6, 1e5, 16, 1024)
    packed = estimate_packing(lengths, Packing(256), planned_batches=100, graphs=2, cost=cost)
    assert packed.rows == len(pack_rows(lengths, range(len(lengths)), Packing(256)))
    assert packed.steps == pytest.approx(100 * packed.rows / len(lengths))
    assert packed.seconds == pytest.approx(10.0 + packed.steps * cost.step_seconds(256))
    assert packed.seconds < bucketing_seconds(lengths, [256], planned_batches=100, graphs_per_bucket=2, cost=cost)
    # one sample a row: packing saves nothing, and a row as long as the longest costs more than short buckets
    even = [70] * 50 + [128]
    one_each = estimate_packing(even, Packing(128), planned_batches=100, graphs=1, cost=cost)
    assert one_each.rows == 51
    assert one_each.seconds > bucketing_seconds(even, [72, 128], planned_batches=100, graphs_per_bucket=1, cost=cost)


def test_docs_limit_fits_the_shortest_sample_and_is_capped():
    assert docs_limit(10, 128) == 12 and docs_limit(1, 4096) == 64 and docs_limit(500, 128) == 1


def test_packing_refuses_what_the_model_inputs_rule_out():
    packs = ModelInputs(mask="4d", position_ids=True)
    assert packing_refusal(packs, "causal-lm", 2, 128) is None
    assert "num_labels" in packing_refusal(packs, "sequence-classification", 1, 128)
    assert "does not honour" in packing_refusal(ModelInputs(unpackable="x does not honour"), "causal-lm", 2, 128)
    windowed = ModelInputs(position_ids=True, sliding_window=64)
    assert "sliding window of 64" in packing_refusal(windowed, "causal-lm", 2, 128)
    assert packing_refusal(windowed, "causal-lm", 2, 64) is None


def _plan(recipe: str, *overrides: str):
    small = ["data.train_samples=300", "data.eval_samples=20", "train.max_steps=20"]
    return make_plan(load_recipe(RECIPES / f"{recipe}.yaml", [*small, *overrides]), "eager")


@pytest.mark.parametrize("recipe", ["tiny-bert-classification", "tiny-llama-clm"])
def test_a_packed_plan_has_one_row_length_and_little_padding(recipe: str):
    plan = _plan(recipe, "data.packing=on")
    (length,) = plan.buckets
    assert plan.bucket_mode == "packed" and plan.packing.row_length == length
    assert plan.expected_graphs() == [("setup",), ("train", length), ("eval", length)]
    assert plan.padding_fraction() <= 0.05
    assert all(b.rows is not None for b in plan.eval_batches)
    unpacked = _plan(recipe, "data.packing=off")
    assert plan.packing_summary["unpacked"] == unpacked.packing_summary["unpacked"]
    assert plan.packing_summary["padding_fraction"] < unpacked.packing_summary["unpacked"]["padding_fraction"]
    assert unpacked.packing is None and unpacked.packing_summary["chosen"] is False


def test_yaml_on_and_off_are_the_packing_modes_and_off_keeps_old_fingerprints():
    shipped = load_recipe(RECIPES / "tiny-llama-clm.yaml")
    assert shipped.data.packing == "auto"  # the shipped recipes pack where the planner proves it safe and cheaper
    assert load_recipe(RECIPES / "tiny-llama-clm.yaml", ["data.packing=on"]).data.packing == "on"
    off = load_recipe(RECIPES / "tiny-llama-clm.yaml", ["data.packing=off"])
    # off leaves the packing settings out of the fingerprint, as before they existed: bucketed runs keep their hash
    ignored = load_recipe(RECIPES / "tiny-llama-clm.yaml", ["data.packing=off", "data.max_docs_per_row=3"])
    assert off.data.packing == "off" and off.fingerprint() == ignored.fingerprint() != shipped.fingerprint()
    assert load_recipe(RECIPES / "tiny-llama-clm.yaml", ["data.packing=on"]).fingerprint() != shipped.fingerprint()


def test_auto_packs_where_the_cost_model_says_so_and_says_why():
    plan = _plan("tiny-bert-classification", "data.packing=auto")
    assert plan.bucket_mode == "packed" and plan.packing_summary["chosen"] is True
    assert any(note.startswith("data.packing auto: packing:") for note in plan.notes)
    summary = plan.packing_summary
    assert summary["estimate_seconds"] < summary["unpacked"]["estimate_seconds"]
    # a step keeps its meaning: about data.batch_size (16) samples, in fewer rows
    rows = summary["rows_per_step"]
    assert plan.recipe.data.batch_size == plan.batcher.batch_size == rows < 16
    assert abs(rows * summary["samples_per_row"] - 16) <= summary["samples_per_row"] / 2
    assert plan.recipe.data.eval_batch_size == 16 and "packed rows a step (about" in plan.notes[-1]
    # compiles that cost nothing and rows of the longest sample: buckets [.., 128] beat rows of 128 here
    costly_rows = _plan(
        "tiny-bert-classification",
        "data.packing=auto",
        "data.max_docs_per_row=1",
        "data.auto_buckets.compile_seconds=0.001",
    )
    assert costly_rows.packing is None and costly_rows.bucket_mode == "auto"
    assert any(note.startswith("data.packing auto: no packing:") for note in costly_rows.notes)
    # train.global_batch_size counts samples: 32 = 8 x 2 workers x 2 unpacked, so 2 micro-steps of packed rows
    small = ["data.train_samples=300", "data.eval_samples=20", "train.max_steps=20", "train.global_batch_size=32"]
    two = make_plan(load_recipe(RECIPES / "tiny-llama-clm.yaml", small), "eager", world=2)
    assert two.bucket_mode == "packed" and two.recipe.train.grad_accum == 2 and two.recipe.data.batch_size < 8


def test_packing_refuses_a_model_it_cannot_isolate():
    deberta = "model.config.model_type=deberta-v2"
    with pytest.raises(UsageError, match="data.packing: on: deberta-v2 does not honour a 4D additive attention mask"):
        _plan("tiny-bert-classification", "data.packing=on", deberta)
    plan = _plan("tiny-bert-classification", "data.packing=auto", deberta)
    assert plan.packing is None and "deberta-v2" in plan.packing_summary["reason"]


def test_packed_collation_matches_the_plan_document_limit():
    plan = _plan("tiny-bert-classification", "data.packing=on")
    batch = next(plan.batcher.iterate(0))
    out = plan.collator("train", 0)(batch)
    assert out["labels"].shape == (16, plan.packing.max_docs) and out["loss_items"] == len(batch.indices)
    assert torch.equal(out["document_ids"] > 0, out["input_ids"] != plan.data.pad_id)


def _best_fit_by_definition(lengths, order, row_length, max_docs):
    """Best-fit decreasing as pack_rows's docstring defines it, one sample and every row at a time."""
    rows, left, reached = [], [], []
    for t, i in enumerate(sorted(order, key=lambda i: -min(lengths[i], row_length))):
        need = max(min(lengths[i], row_length), 1)
        fits = [r for r, room in enumerate(left) if room >= need and (max_docs is None or len(rows[r]) < max_docs)]
        if fits:
            row = min(fits, key=lambda r: (left[r], -reached[r]))  # the fullest; of equals, the last to get there
        else:
            rows.append([]), left.append(row_length), reached.append(t)
            row = len(rows) - 1
        rows[row].append(i)
        left[row] -= need
        reached[row] = t
    return [tuple(row) for row in rows]


def test_pack_rows_places_runs_of_one_length_as_best_fit_places_each_sample():
    for trial in range(200):
        rng = random.Random(trial)
        row_length = rng.choice([8, 16, 33, 128])
        lengths = [rng.randint(0, row_length + 10) for _ in range(rng.randint(0, 200))]
        order = rng.sample(range(len(lengths)), rng.randint(0, len(lengths)))
        max_docs = rng.choice([None, 1, 2, 5])
        expected = _best_fit_by_definition(lengths, order, row_length, max_docs)
        assert pack_rows(lengths, order, Packing(row_length, max_docs)) == expected, trial
