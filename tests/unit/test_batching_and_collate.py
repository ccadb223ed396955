import torch

from neurontrain.data.batching import Batcher, IndexBatch, fixed_batches
from neurontrain.data.collate import IGNORE_INDEX, Collator


def batcher(**kw):
    lengths = tuple([5, 9, 17, 30, 31, 3, 12, 40, 8, 22] * 5)
    args = dict(lengths=lengths, batch_size=4, buckets=(16, 32, 48), shuffle=True, seed=1, drop_last=True, multiple=8)
    args.update(kw)
    return Batcher(**args)


def test_batches_stay_in_their_bucket_and_have_fixed_size():
    p = batcher()
    for batch in p.epoch(0):
        assert len(batch.indices) == 4
        assert batch.length in (16, 32, 48)
        assert all(p.lengths[i] <= batch.length for i in batch.indices)


def test_batch_order_is_deterministic_and_resumable():
    p = batcher()
    stream = [b for _, b in zip(range(60), p.iterate(0))]
    again = [b for _, b in zip(range(60), p.iterate(0))]
    assert stream == again
    resumed = [b for _, b in zip(range(35), p.iterate(25))]
    assert resumed == stream[25:60]
    assert p.epoch(0) != p.epoch(1)


def test_dynamic_padding_uses_batch_maximum():
    p = batcher(buckets=None, multiple=1)
    for batch in p.epoch(0):
        assert batch.length == max(p.lengths[i] for i in batch.indices)


def test_pad_policy_keeps_partial_batches():
    keep = batcher(drop_last=False)
    drop = batcher(drop_last=True)
    assert sum(len(b.indices) for b in keep.epoch(0)) == len(keep.lengths)
    assert sum(len(b.indices) for b in drop.epoch(0)) < len(drop.lengths)


def test_fixed_batches_cover_every_sample_once():
    lengths = [5, 9, 17, 30, 31, 3, 12]
    batches = fixed_batches(lengths, 3, [16, 32])
    assert sorted(i for b in batches for i in b.indices) == list(range(len(lengths)))


def test_collate_classification_pads_rows_and_ignores_dummy_labels():
    ids = [[1, 5, 6, 2], [1, 7, 2]]
    collate = Collator(ids, [1, 0], "sequence-classification", batch_size=3, pad_id=0)
    out = collate(IndexBatch(8, (0, 1)))
    assert out["input_ids"].shape == (3, 8)
    assert out["attention_mask"].sum().item() == 7 == out["real_tokens"]
    assert out["labels"].tolist() == [1, 0, IGNORE_INDEX]
    assert out["input_ids"][2].tolist() == [0] * 8


def test_collate_causal_lm_ignores_padding_in_labels():
    collate = Collator([[1, 5, 6, 2]], None, "causal-lm", batch_size=1, pad_id=0)
    out = collate(IndexBatch(6, (0,)))
    assert out["labels"].tolist() == [[1, 5, 6, 2, IGNORE_INDEX, IGNORE_INDEX]]
    assert out["input_ids"].dtype == torch.long
