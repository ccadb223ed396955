"""data.streaming in this process: rows packed from local JSON-lines shards, restarted at any row's position,
split over workers; the recipe's refusals; the plan; a run killed and resumed on the eager backend."""

import dataclasses
import itertools
import zlib
from pathlib import Path

import pytest
import torch
from conftest import RECIPES
from safetensors.torch import load_file
from stream_shards import shard_texts, write_shards

from neurontrain.backends import select_backend
from neurontrain.data.stream_source import Stream, list_shards, read_head, read_lines
from neurontrain.data.streaming import POSITION_KEY, StreamPosition, pack_rows, shard_order
from neurontrain.errors import UsageError
from neurontrain.loop.trainer import Trainer
from neurontrain.plan.description import describe_plan
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe

ROW = 32


def _tokenize(texts: list[str]) -> list[list[int]]:
    return [[1] + [2 + zlib.crc32(w.encode()) % 500 for w in t.split()] + [0] for t in texts]


def _stream(root: Path, eval_docs: int = 5, batch_size: int = 2, shuffle: bool = True) -> Stream:
    shards = list_shards(str(root))
    head = read_head(shards, "text", eval_docs, 0)
    return Stream(shards, "text", _tokenize, 0, ROW, 7, shuffle, head.holdout, batch_size)


def _flat(rows) -> list[int]:
    return [t for row in rows for piece in row.pieces for t in piece]


def test_rows_are_full_keep_every_token_and_skip_the_eval_documents(tmp_path: Path):
    write_shards(tmp_path, shards=3, per_shard=20)
    stream = _stream(tmp_path, eval_docs=5)
    texts = shard_texts(3, 20)
    # the training documents of epoch 0, in the epoch's shard order; the first shard's first 5 are the eval set
    expected = [t for k in shard_order(3, 0, 7, True) for t in (texts[k][5:] if k == 0 else texts[k])]
    tokens = [t for ids in _tokenize(expected) for t in ids]
    rows = list(itertools.islice(pack_rows(stream.documents(StreamPosition()), ROW), len(tokens) // ROW + 30))
    assert all(sum(len(p) for p in row.pieces) == ROW for row in rows)  # full rows: no padding
    assert _flat(rows)[: len(tokens)] == tokens  # every token, in order, none dropped
    assert rows[len(tokens) // ROW + 1].after.epoch == 1  # the stream goes on into the next epoch
    assert any(row.after.offset > 0 for row in rows)  # documents do continue across rows
    assert shard_order(3, 1, 7, True) != shard_order(3, 0, 7, True) or shard_order(3, 2, 7, True) != [0, 1, 2]


def test_a_stream_restarted_at_any_row_packs_the_rows_an_uninterrupted_one_did(tmp_path: Path):
    write_shards(tmp_path, shards=3, per_shard=12)
    stream = _stream(tmp_path)
    rows = list(itertools.islice(pack_rows(stream.documents(StreamPosition()), ROW), 80))
    for k in range(len(rows) - 5):
        resumed = pack_rows(stream.documents(rows[k].after), ROW)
        assert [r.pieces for r in itertools.islice(resumed, 5)] == [r.pieces for r in rows[k + 1 : k + 6]], k


def test_lines_read_from_a_byte_offset_are_the_rest_of_the_shard(tmp_path: Path):
    path = write_shards(tmp_path, shards=1, per_shard=6)[0]  # the last shard: no final newline
    lines = list(read_lines(str(path)))
    assert [line for *_, line in lines] == path.read_bytes().split(b"\n")
    for record, byte, _, _ in lines:
        assert list(read_lines(str(path), byte, record)) == lines[record:]


def test_each_worker_collates_its_rows_of_the_global_batch(tmp_path: Path):
    write_shards(tmp_path, shards=2, per_shard=12)
    one = list(dataclasses.replace(_stream(tmp_path), batch_size=4).batches(0, 1, None, 5))
    two = [list(_stream(tmp_path).batches(rank, 2, None, 5)) for rank in (0, 1)]
    for whole, mine, theirs in zip(one, *two, strict=True):
        assert torch.equal(whole["input_ids"][0::2], mine["input_ids"])
        assert torch.equal(whole["labels"][1::2], theirs["labels"])
        assert whole[POSITION_KEY] == mine[POSITION_KEY] == theirs[POSITION_KEY]
        assert whole["real_tokens"] == mine["real_tokens"] + theirs["real_tokens"] == 4 * ROW
    resumed = list(_stream(tmp_path).batches(1, 2, one[2][POSITION_KEY], 2))  # from a checkpoint's position
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(resumed, two[1][3:], strict=True))


def test_positions_and_shards_are_checked(tmp_path: Path):
    assert StreamPosition.from_dict(StreamPosition(1, 2, 3, 4, 5).as_dict()) == StreamPosition(1, 2, 3, 4, 5)
    for bad in ({"epoch": 0}, {**StreamPosition().as_dict(), "byte": -1}, {**StreamPosition().as_dict(), "shard": "0"}):
        with pytest.raises(ValueError):
            StreamPosition.from_dict(bad)
    with pytest.raises(UsageError, match="no JSON-lines shards"):
        list_shards(str(tmp_path))
    write_shards(tmp_path, shards=2, per_shard=4)
    assert [Path(s).name for s in list_shards(str(tmp_path / "part-*.jsonl"))] == ["part-000.jsonl", "part-001.jsonl"]
    with pytest.raises(UsageError, match="leaves none to train on"):
        read_head(list_shards(str(tmp_path)), "text", 8, 0)
    with pytest.raises(UsageError, match=r"line 1: no field 'body' \(data.text_field\)"):
        read_head(list_shards(str(tmp_path)), "body", 1, 0)


STREAM = ["data.streaming=true", "data.source=json", "data.buckets=auto", "data.train_samples=null"]


def _recipe(path: Path, *overrides: str):
    small = ["data.max_length=32", "data.batch_size=2", "data.eval_samples=4", "train.log_every=1"]
    base = [*small, "checkpoint.every=2", "train.schedule.warmup_steps=1", f"data.path={path}"]
    return load_recipe(RECIPES / "tiny-llama-clm.yaml", [*STREAM, *base, *overrides])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.source=csv", "data.streaming reads JSON-lines shards: set data.source: json (got csv)"),
        ("data.buckets=[16, 32]", "data.streaming packs rows of data.max_length: leave data.buckets unset"),
        ("data.packing=off", "data.streaming packs rows: data.packing: off contradicts it"),
        ("data.overlong=truncate", "data.streaming cuts no document: leave data.overlong unset"),
        ("data.eval_split=test", "data.streaming evaluates its first documents: leave data.eval_split unset"),
        ("data.train_samples=10", "data.streaming reads the stream to its end: leave data.train_samples unset"),
        ("data.service.kind=ray", "data.streaming is read by every worker itself: data.service.kind must be none"),
        ("task=sequence-classification", "task sequence-classification does not stream"),
    ],
)
def test_what_a_stream_cannot_honour_is_refused_in_one_line(tmp_path: Path, override: str, message: str):
    with pytest.raises(UsageError, match="^recipe .*: (data|task)") as err:
        _recipe(tmp_path, override)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_streaming_plan_has_one_train_graph_and_says_it_streams(tmp_path: Path):
    write_shards(tmp_path, shards=2, per_shard=10)
    recipe = _recipe(tmp_path, "train.max_steps=3")
    assert recipe.fingerprint() != _recipe(tmp_path, "train.max_steps=3", "data.streaming=false").fingerprint()
    plan = make_plan(recipe, "eager")
    assert plan.expected_graphs() == [("setup",), ("train", 32), ("eval", 32)]
    described = describe_plan(plan)
    assert described["data"]["streaming"] is True and described["data"]["shards"] == 2
    assert described["batches_per_epoch"] is None and described["padding_fraction"] == 0.0
    assert described["data"]["eval_rows"] == sum(len(b.rows) for b in plan.eval_batches) > 0


class _Killed(Exception):
    pass


def test_a_streaming_run_killed_and_resumed_continues_bit_identically(tmp_path: Path):
    write_shards(tmp_path / "shards", shards=3, per_shard=15)
    backend = select_backend("eager")

    def plan():
        return make_plan(_recipe(tmp_path / "shards", "train.max_steps=5"), "eager")

    Trainer(plan(), backend, tmp_path / "straight").run()
    killed = Trainer(plan(), backend, tmp_path / "resumed")
    save = killed.maybe_save

    def save_then_die(step: int) -> None:
        save(step)
        if step == 3:
            raise _Killed  # after step 3: the resumed run repeats it from step 2's checkpoint

    killed.maybe_save = save_then_die
    with pytest.raises(_Killed):
        killed.run()
    state = torch.load(tmp_path / "resumed" / "checkpoints" / "step_00000002" / "state.pt", weights_only=False)
    assert StreamPosition.from_dict(state["stream_position"]) != StreamPosition()
    summary = Trainer(plan(), backend, tmp_path / "resumed").run()
    assert summary.resumed_from_step == 2 and summary.samples_trained == 5 * 2
    a, b = (load_file(str(tmp_path / run / "model" / "model.safetensors")) for run in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
