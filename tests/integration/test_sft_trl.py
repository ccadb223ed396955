"""The tokens the toolkit trains on (neurontrain/data/sft.py, the store's loss mask, the collator) are exactly the
ones TRL's SFTTrainer labels for the same tokenizer, template and records: conversations (the tokenizer's own
template and a template file) and prompt-completion data (conversational and strings). In process; in this tier
because importing TRL's trainer takes half a minute."""

import json
from pathlib import Path

import pytest
import trl
from sft_data import MAX_LENGTH, RECORDS, recipe_dict, records_of, save_tokenizer, write_records

from neurontrain.data.batching import IndexBatch
from neurontrain.data.collate import IGNORE_INDEX, Collator
from neurontrain.data.sft import CHATML
from neurontrain.data.sources import prepare_data
from neurontrain.recipe import Recipe


def _trl_labels(tmp_path: Path, records: list[dict], template_file: Path | None, assistant_only: bool) -> list:
    """(input_ids, labels) of each record as TRL's SFTTrainer prepares them."""
    import datasets
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), num_key_value_heads=1, **sizes))
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"),
        max_length=MAX_LENGTH,
        assistant_only_loss=assistant_only,
        chat_template_path=str(template_file) if template_file else None,
        report_to=[],
    )
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                             processing_class=tok)  # fmt: skip
    prepared = trainer.train_dataset
    return [(list(i), list(lab)) for i, lab in zip(prepared["input_ids"], prepared["labels"], strict=True)]


def _trained(ids, labels) -> tuple[list[int], list[int]]:
    """The ids and the positions (from 1: the first token is predicted by nothing) the loss is on."""
    return list(ids), [t for t in range(1, len(labels)) if labels[t] != IGNORE_INDEX]


CASES = {  # records, the template the tokenizer has, the one the recipe names, TRL's assistant_only_loss
    "messages, the tokenizer's own template": ("messages", "qwen", None, True),
    "messages, a template file": ("messages", None, "file", True),
    "conversational prompt-completion": ("conversational prompt-completion", "qwen", None, False),
    "prompt-completion strings": ("prompt-completion strings", None, None, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_trained_tokens_are_trls(tmp_path: Path, monkeypatch, case: str):
    monkeypatch.setenv("NEURONTRAIN_DATA_CACHE", str(tmp_path / "store"))
    # TRL's trainer probes torch-xla; an in-process CLI test before this one may leave PJRT_DEVICE unset
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    kind, own, named, assistant_only = CASES[case]
    qwen = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5_training.jinja").read_text()
    records = records_of(kind)
    corpus = [json.dumps(r) for r in records]
    save_tokenizer(tmp_path / "tok", corpus, qwen if own == "qwen" else None)
    template_file = None
    if named == "file":
        template_file = tmp_path / "chat.jinja"
        template_file.write_text(CHATML)
    write_records(tmp_path, records)
    data = {"chat_template": str(template_file)} if template_file else {}
    prepared = prepare_data(Recipe.model_validate(recipe_dict(tmp_path, data)))
    expected = _trl_labels(tmp_path, records, template_file, assistant_only)
    assert prepared.train_masks is not None and len(prepared.train_ids) == len(expected) == RECORDS
    collate = Collator(prepared.train_ids, None, "causal-lm", 1, prepared.pad_id, loss_masks=prepared.train_masks)
    total = 0
    for index, (ids, labels) in enumerate(expected):
        batch = collate.arrays(IndexBatch(len(prepared.train_ids[index]), (index,)))
        mine = _trained(batch["input_ids"][0], batch["labels"][0])
        assert mine == _trained(ids, labels), (case, index)
        assert 0 < len(mine[1]) < len(ids) - 1  # a part of the record, not all of it
        assert batch["loss_items"] == len(mine[1])
        total += len(mine[1])
    assert prepared.store["trained_tokens"]["train"] == total
