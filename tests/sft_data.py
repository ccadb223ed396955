"""Shared by the SFT data tests: a tokenizer with ChatML's markers, generated conversations in TRL's formats, a tiny
causal-LM recipe reading them from a JSON-lines file."""

import json
from pathlib import Path

from neurontrain.data import synthetic

MAX_LENGTH = 512
RECORDS = 24


def save_tokenizer(directory: Path, corpus: list[str], template: str | None) -> None:
    """A byte-level BPE with ChatML's markers as special tokens, saved with `template` as its own chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=alphabet)
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    wrapped.chat_template = template
    wrapped.save_pretrained(directory)


def conversations() -> list[list[dict]]:
    return [r["messages"] for r in synthetic.iter_conversations(RECORDS, seed=3)]


def records_of(kind: str) -> list[dict]:
    chats = conversations()
    if kind == "messages":
        return [{"messages": m} for m in chats]
    if kind == "conversational prompt-completion":
        return [{"prompt": m[:-1], "completion": m[-1:]} for m in chats]
    return [{"prompt": f"question: {m[-2]['content']} answer:", "completion": " " + m[-1]["content"]} for m in chats]


def recipe_dict(tmp_path: Path, data: dict) -> dict:
    return {
        "name": "sft",
        "task": "causal-lm",
        "model": {
            "config": {
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
            }
        },  # fmt: skip
        "tokenizer": {"pretrained": str(tmp_path / "tok")},
        "data": {"source": "json", "path": str(tmp_path / "d.jsonl"), "max_length": MAX_LENGTH, "batch_size": 2} | data,
        "train": {"max_steps": 2, "optimizer": {"lr": 1e-3}},
    }


def write_records(tmp_path: Path, records: list[dict]) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
