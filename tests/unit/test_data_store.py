"""The tokenized store (neurontrain/data/store.py and data/sources.py) and the overlong policies, in process: a
recipe's data is tokenized once and reused, rebuilt when what makes the ids changes, refused when corrupt or foreign;
one builder among concurrent callers; `split` keeps every token."""

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import RECIPES

from neurontrain.data.overlong import fit_documents
from neurontrain.data.sources import prepare_data
from neurontrain.data.store import META, open_or_build, store_root
from neurontrain.data.token_seqs import TokenSeqs
from neurontrain.data.tokenizers import build_tokenizer, encoder_for
from neurontrain.errors import UsageError
from neurontrain.recipe import load_recipe


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("NEURONTRAIN_DATA_CACHE", str(tmp_path / "store"))
    return tmp_path / "store"


def _llama(*overrides: str):
    return load_recipe(RECIPES / "tiny-llama-clm.yaml", ["data.train_samples=300", *overrides])


def test_overlong_policies_count_every_token():
    docs = [list(range(10)), list(range(3)), list(range(25))]
    samples, origin, counts = fit_documents(docs, 8, "split", "train")
    assert [len(s) for s in samples] == [8, 2, 3, 8, 8, 8, 1] and origin == [0, 0, 1, 2, 2, 2, 2]
    assert [t for s in samples for t in s] == [t for d in docs for t in d]
    assert (counts.kept_tokens, counts.dropped_tokens, counts.split, counts.samples) == (38, 0, 2, 7)
    samples, origin, counts = fit_documents(docs, 8, "truncate", "train")
    assert [len(s) for s in samples] == [8, 3, 8] and origin == [0, 1, 2]
    assert (counts.kept_tokens, counts.dropped_tokens, counts.truncated) == (19, 19, 2)
    with pytest.raises(UsageError, match="train sample 12 has 10 tokens, more than data.max_length 8"):
        fit_documents(docs, 8, "fail", "train", first_index=12)


def test_token_seqs_are_views_of_one_array_and_cut_only_their_lengths():
    seqs = TokenSeqs.from_lists([[1, 2, 3], [], [4, 5]])
    assert [s.tolist() for s in seqs] == [[1, 2, 3], [], [4, 5]] and seqs.total_tokens == 5
    assert np.shares_memory(seqs[0], seqs.tokens)
    seqs.truncate(0, 2)
    seqs.truncate(2, 9)
    assert [s.tolist() for s in seqs] == [[1, 2], [], [4, 5]] and seqs.lengths == [2, 0, 2]
    offsets = TokenSeqs.from_offsets(np.arange(6), np.array([0, 4, 6]))
    assert [s.tolist() for s in offsets] == [[0, 1, 2, 3], [4, 5]]


def test_the_encoder_gives_the_tokenizers_own_ids():
    recipe = _llama()
    texts = ["the old cat sees the dog .", "", "unknownword near the river ."] * 3
    tokenizer = build_tokenizer(recipe, texts)
    expected = tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]
    assert encoder_for(tokenizer)(texts) == expected


def test_a_second_preparation_tokenizes_nothing_and_maps_the_same_ids(store):
    first = prepare_data(_llama())
    assert first.store["tokenized_documents"] == 300 + 32 and Path(first.store["path"]).parent == store
    second = prepare_data(_llama())
    assert second.store["tokenized_documents"] == 0 and second.store["path"] == first.store["path"]
    assert isinstance(second.train_ids.tokens, np.memmap)
    assert second.train_lengths == first.train_lengths and second.eval_lengths == first.eval_lengths
    assert all(np.array_equal(a, b) for a, b in zip(first.train_ids, second.train_ids, strict=True))
    assert second.tokenizer.get_vocab() == first.tokenizer.get_vocab() and second.pad_id == first.pad_id
    # what changes the ids makes another entry: the tokenizer, the length limit, the data
    for change in ("tokenizer.word_level.vocab_size=200", "data.max_length=64", "data.seed=1"):
        other = prepare_data(_llama(change))
        assert other.store["tokenized_documents"] > 0 and other.store["path"] != first.store["path"], change
    # what does not (batching) reuses it
    assert prepare_data(_llama("data.batch_size=4", "data.packing=on")).store["tokenized_documents"] == 0


def test_split_is_the_causal_default_and_keeps_every_token(store):
    split = prepare_data(_llama("data.max_length=32"))
    cut = prepare_data(_llama("data.max_length=32", "data.overlong=truncate"))
    assert split.store["tokens_dropped"] == 0 and split.store["documents_split"] > 0
    assert cut.store["tokens_dropped"] > 0 and cut.store["documents_truncated"] == split.store["documents_split"]
    assert split.store["tokens_kept"] == cut.store["tokens_kept"] + cut.store["tokens_dropped"]
    assert max(split.train_lengths) <= 32 and split.train_samples > cut.train_samples == 300
    with pytest.raises(Exception, match="data.overlong: split makes several samples of one document"):
        load_recipe(RECIPES / "tiny-bert-classification.yaml", ["data.overlong=split"])


def test_a_corrupt_or_foreign_entry_is_refused_and_rebuilt(store, caplog):
    first = prepare_data(_llama())
    entry = Path(first.store["path"])
    ids = [a.tolist() for a in first.train_ids]
    tokens = entry / "train.tokens"
    data = bytearray(tokens.read_bytes())
    data[10] ^= 0xFF  # one flipped byte, same size
    tokens.write_bytes(bytes(data))
    again = prepare_data(_llama())
    assert again.store["tokenized_documents"] > 0 and "train.tokens does not match its digest" in caplog.text
    assert [a.tolist() for a in again.train_ids] == ids
    meta = json.loads((entry / META).read_text())
    meta["material"]["max_length"] = 7  # an entry made for other settings under this key
    (entry / META).write_text(json.dumps(meta))
    assert prepare_data(_llama()).store["tokenized_documents"] > 0 and "built for other data" in caplog.text


def test_concurrent_callers_wait_for_one_builder(store):
    builds = []

    def build(directory: Path) -> dict:
        builds.append(directory)
        (directory / "x.bin").write_bytes(b"ids")
        threading.Event().wait(0.3)  # the others arrive while this one builds
        return {"splits": {}}

    entries = []
    threads = [threading.Thread(target=lambda: entries.append(open_or_build({"k": 1}, build))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and sum(e.built for e in entries) == 1 and len({e.path for e in entries}) == 1
    assert sorted(p.name for p in store_root().iterdir() if not p.name.endswith(".lock")) == [entries[0].path.name]


def test_a_changed_data_file_is_tokenized_again(store, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"the cat sees the dog {i} ."}) + "\n" for i in range(40)))
    overrides = ["data.source=json", f"data.path={path}", "data.train_samples=30", "data.eval_samples=4"]
    first = prepare_data(_llama(*overrides))
    assert first.store["tokenized_documents"] == 34 and first.train_samples == 30 and len(first.eval_ids) == 4
    assert prepare_data(_llama(*overrides)).store["tokenized_documents"] == 0
    path.write_text(path.read_text() + json.dumps({"text": "a new line ."}) + "\n")
    assert prepare_data(_llama(*overrides)).store["tokenized_documents"] == 34


def test_split_documents_train_packed_as_unpacked_on_the_same_pieces(store, tmp_path):
    """Documents of 1,024 tokens (1,022 words, the bos and eos) at max_length 128: eight pieces each, every token
    kept; packed rows then hold one piece each, in the order unpacked batches do, so the losses must agree."""
    from neurontrain.backends import select_backend
    from neurontrain.loop.trainer import Trainer
    from neurontrain.plan.planning import make_plan

    path = tmp_path / "long.jsonl"
    words = "the old cat sees the young dog near the river .".split()
    rows = [" ".join(words[(i + j) % len(words)] for j in range(1022)) for i in range(6)]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in rows))
    common = [
        "data.source=json",
        f"data.path={path}",
        "data.train_samples=6",
        "data.eval_samples=0",
        "data.shuffle=false",
        "data.buckets=[128]",
        "data.batch_size=4",
        "train.max_steps=3",
        "train.schedule.warmup_steps=1",
        "train.log_every=1",
        "train.eval_at_end=false",
        "checkpoint.every=0",
        "checkpoint.save_final=false",
    ]
    losses = {}
    for packing in ("on", "off"):
        plan = make_plan(_llama(*common, f"data.packing={packing}"), "eager")
        assert plan.data.store["tokens_kept"] == 6 * 1024 and plan.data.store["tokens_dropped"] == 0
        assert plan.data.train_lengths == [128] * 48
        summary = Trainer(plan, select_backend("eager"), tmp_path / packing).run()
        assert summary.padding_fraction == 0.0
        lines = (tmp_path / packing / "metrics.jsonl").read_text().splitlines()
        losses[packing] = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
    assert len(losses["on"]) == 3 and losses["on"] == pytest.approx(losses["off"], rel=1e-5, abs=1e-6)
