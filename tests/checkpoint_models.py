"""Tiny Hugging Face models saved to disk, and readers of what migration writes, for the checkpoint tests."""

import torch
from safetensors.torch import load_file

HEADS, KV, HEAD_DIM, HIDDEN, VOCAB, LAYERS = 8, 2, 8, 64, 128, 4


def llama(tmp_path, tied=False, name="hf", vocab=VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HEAD_DIM,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / name)
    return model, tmp_path / name


def bert(tmp_path, vocab=VOCAB):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    model.save_pretrained(tmp_path / "bert")
    return model, tmp_path / "bert"


def hf_tensors(path):
    return load_file(str(path / "model.safetensors"))


def rank_file(path, tp, pp):
    return torch.load(path / "model" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt", weights_only=True)
