"""SFT data (neurontrain/data/sft.py, the loss mask in the tokenized store and the collator), in process: masks
survive packing, overlong conversations are truncated or dropped, and the bad inputs are one-line errors (exit 2)
before anything compiles. tests/integration/test_sft_trl.py checks the masks against TRL's; `sft_data` is shared."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from bad_input import assert_one_line_usage_error
from conftest import cli_in_process
from sft_data import recipe_dict, save_tokenizer, write_records

from neurontrain.data.batching import IndexBatch
from neurontrain.data.collate import Collator
from neurontrain.data.sft import CHATML
from neurontrain.data.sources import prepare_data
from neurontrain.recipe import Recipe


def test_masks_survive_packing():
    """A packed row: each document's labels are its own mask's (never its first token: no prediction crosses a
    boundary); unmasked tokens are -100 as in an unpacked batch."""
    from neurontrain.data.token_seqs import TokenSeqs

    ids = TokenSeqs.from_lists([[5, 6, 7, 8], [9, 10, 11]])
    masks = TokenSeqs.from_lists([[0, 0, 1, 1], [1, 0, 1]])
    collate = Collator(ids, None, "causal-lm", 1, 0, loss_masks=masks)
    batch = collate.arrays(IndexBatch(8, (0, 1), ((0, 1),)))
    assert batch["labels"][0].tolist() == [-100, -100, 7, 8, -100, -100, 11, -100]
    assert batch["document_ids"][0].tolist() == [1, 1, 1, 1, 2, 2, 2, 0] and batch["loss_items"] == 3


def _bad(tmp_path: Path, records: list[dict], data: dict, template: str | None, capsys) -> tuple[int, str]:
    save_tokenizer(tmp_path / "tok", [json.dumps(r) for r in records], template)
    write_records(tmp_path, records)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe_dict(tmp_path, data)))
    code, _, err = cli_in_process(capsys, "run", str(tmp_path / "r.yaml"), "--dry-run", "--backend", "eager")

    class Result:
        returncode, stderr = code, err

    return Result


CHAT = [{"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]}] * 4
PLAIN = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
BAD = {
    "fields missing for the format": (
        [{"question": "a", "answer": "b"}] * 4, {"format": "prompt-completion"}, None,
        "data.format prompt-completion needs the field(s) prompt, completion"),
    "no field of any format": ([{"question": "a"}] * 4, {}, None, "data.text_field 'text' is not a column"),
    "several formats fit": (
        [{"text": "a", "prompt": "b", "completion": "c"}] * 4, {}, None, "fits several formats"),
    "no chat template for messages": (CHAT, {}, None, "messages data needs a chat template"),
    "a template that cannot mark assistant turns": (CHAT, {}, PLAIN, "cannot mark assistant turns"),
    "a template file that does not exist": (CHAT, {"chat_template": "/no/such.jinja"}, None, "is neither a file"),
    "nothing to train on in every record": (
        [{"messages": [{"role": "user", "content": "a " * 40}, {"role": "assistant", "content": "b"}]}] * 4,
        {"max_length": 16}, CHATML, "no training sample has a token to train on"),
    "messages that are not messages": ([{"messages": "hello"}] * 4, {}, CHATML, "not a non-empty list"),
    "loss on completions of conversations": (CHAT, {"loss_on": "completion"}, CHATML, "needs prompt-completion"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sft_input(tmp_path: Path, monkeypatch, capsys, case: str):
    monkeypatch.setenv("NEURONTRAIN_DATA_CACHE", str(tmp_path / "store"))
    records, data, template, expected = BAD[case]
    assert_one_line_usage_error(_bad(tmp_path, records, data, template, capsys), expected)


def test_overlong_conversations_are_truncated_or_dropped(tmp_path: Path, monkeypatch):
    """data.overlong split (the causal-LM default) never cuts a conversation into pieces: it is truncated, and
    dropped (counted) where no answer token is left."""
    monkeypatch.setenv("NEURONTRAIN_DATA_CACHE", str(tmp_path / "store"))
    long_answer = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a " * 60}]}
    long_question = {"messages": [{"role": "user", "content": "q " * 60}, {"role": "assistant", "content": "a"}]}
    records = [long_answer, long_question, *CHAT]
    save_tokenizer(tmp_path / "tok", [json.dumps(r) for r in records], CHATML)
    write_records(tmp_path, records)
    recipe = Recipe.model_validate(recipe_dict(tmp_path, {"max_length": 32}))
    assert recipe.data.overlong == "split"
    prepared = prepare_data(recipe)
    assert prepared.train_lengths == [32, *(len(prepared.train_ids[i]) for i in range(1, 5))]
    assert prepared.store["documents_dropped"] == 1 and prepared.store["documents_truncated"] == 1
    assert int(np.asarray(prepared.train_masks[0]).sum()) > 0 and all(n <= 32 for n in prepared.train_lengths)
    again = prepare_data(recipe)  # from the store: the same ids and masks, memory-mapped
    assert again.store["tokenized_documents"] == 0 and again.store["trained_tokens"] == prepared.store["trained_tokens"]
    for i in range(len(prepared.train_ids)):
        assert np.array_equal(again.train_masks[i], prepared.train_masks[i])
        assert np.array_equal(again.train_ids[i], prepared.train_ids[i])


LORA_BAD = {
    "a target module the model does not have": ("{r: 4, target_modules: [q_proj, nope]}", "has no module 'nope'"),
    "rank zero": ("{r: 0}", "model.lora.r"),
}


@pytest.mark.parametrize("case", sorted(LORA_BAD))
def test_bad_lora_settings(case: str, capsys):
    value, expected = LORA_BAD[case]
    recipe = str(Path(__file__).parents[2] / "recipes" / "tiny-llama-sft-lora.yaml")
    code, _, err = cli_in_process(
        capsys, "run", recipe, "--dry-run", "--backend", "eager", "--set", f"model.lora={value}"
    )

    class Result:
        returncode, stderr = code, err

    assert_one_line_usage_error(Result, expected)
