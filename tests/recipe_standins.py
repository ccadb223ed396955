"""Local stand-ins for what a shipped recipe fetches from the hub: a tiny model and its tokenizer saved with
save_pretrained (the tokenizer trained in-process on the stand-in data), and a data file with the recipe's
own fields. Nothing is downloaded. The architecture follows the task: causal-lm gets a Llama (GQA, tied
embeddings, like Llama 3.2), sequence-classification a BERT saved with its pre-training heads, as the hub
checkpoint is."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from neurontrain.data import synthetic
from neurontrain.recipe import Recipe

RECORDS = 72  # training records in a generated data file (the eval records come on top)
EVAL_SAMPLES = 8


def _bpe_tokenizer(corpus: list[str]):
    """Byte-level BPE with Llama 3's special tokens: BOS prepended, no pad token (the loop pads with EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=[bos, eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)


def _wordpiece_tokenizer(corpus: list[str]):
    """Uncased WordPiece with BERT's special tokens and [CLS] A [SEP] framing."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=320, special_tokens=specials))
    tok.post_processor = processors.BertProcessing(
        ("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]"))
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def save_standin_model(recipe: Recipe, directory: Path, corpus: list[str]) -> None:
    import torch
    from transformers import BertConfig, BertForPreTraining, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if recipe.task == "causal-lm":
        tokenizer = _bpe_tokenizer(corpus)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=recipe.data.max_length,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        model = LlamaForCausalLM(config)
    else:
        tokenizer = _wordpiece_tokenizer(corpus)
        config = BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=recipe.data.max_length,
            pad_token_id=tokenizer.pad_token_id,
        )
        model = BertForPreTraining(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def standin_records(recipe: Recipe, n: int) -> list[dict]:
    """Generated records under the recipe's text (and label) field names."""
    data = recipe.data
    if recipe.task == "causal-lm":
        return [{data.text_field: r["text"]} for r in synthetic.story_text(n, data.seed)]
    return [
        {data.text_field: r["content"], data.label_field: r["label"]} for r in synthetic.sentiment_reviews(n, data.seed)
    ]


def write_data_file(records: list[dict], path: Path, source: str) -> None:
    if source == "json":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif source == "csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    else:
        import pandas

        pandas.DataFrame(records).to_parquet(path)


def standin_overrides(recipe: Recipe, workdir: Path) -> list[str]:
    """`--set` arguments that point the recipe's hub or file inputs at generated local ones."""
    out: list[str] = []
    data = recipe.data
    records = None
    if data.source not in ("synthetic-sentiment", "synthetic-text"):
        source = "csv" if data.source == "hub" else data.source
        records = standin_records(recipe, RECORDS + EVAL_SAMPLES)
        path = workdir / ("train.jsonl" if source == "json" else f"train.{source}")
        write_data_file(records, path, source)
        out += [f"data.source={source}", f"data.path={path}", f"data.eval_samples={EVAL_SAMPLES}"]
    if recipe.model.pretrained is not None:
        corpus = [r[data.text_field] for r in records or standin_records(recipe, RECORDS)]
        model_dir = workdir / "model"
        save_standin_model(recipe, model_dir, corpus)
        out.append(f"model.pretrained={model_dir}")
        if recipe.tokenizer.pretrained is not None:
            out.append(f"tokenizer.pretrained={model_dir}")
    return [arg for item in out for arg in ("--set", item)]
