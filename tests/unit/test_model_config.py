"""A bad model.config value is bad input: a UsageError naming its key (exit 2, one line), found before any
weight is allocated, through transformers' own config class and the model built on the meta device."""

import pytest
from conftest import RECIPES

from neurontrain.errors import UsageError
from neurontrain.model.build import build_config, model_dims
from neurontrain.recipe import load_recipe


class _Tokenizer:
    """What build_config reads of a tokenizer: its size and its pad id."""

    pad_token_id = 0

    def __len__(self) -> int:
        return 512


def _check(recipe: str, *overrides: str):
    loaded = load_recipe(RECIPES / f"{recipe}.yaml", list(overrides))
    config = build_config(loaded, _Tokenizer())
    return config, model_dims(loaded, config)


@pytest.mark.parametrize(
    "recipe, override, message",
    [
        ("tiny-bert-classification", "hidden_size=-3", "model.config.hidden_size: -3 must not be negative"),
        ("tiny-llama-clm", "num_hidden_layers=-1", "model.config.num_hidden_layers: -1 must not be negative"),
        ("tiny-bert-classification", "hidden_size=abc", "model.config.hidden_size: 'abc' is not a valid bert config"),
        ("tiny-llama-clm", "num_attention_heads=5", "model.config.num_attention_heads: 5 is not a valid llama config"),
        ("tiny-bert-classification", "hidden_act=nope", "model.config.hidden_act: 'nope' cannot build the bert model"),
        ("tiny-bert-classification", "hidden_dropout_prob=2.0", "model.config.hidden_dropout_prob: 2.0 cannot build"),
        ("tiny-bert-classification", "model_type=nope", "model.config.model_type: 'nope' is not a model type"),
        ("tiny-llama-clm", "vocab_size=100", "model.config.vocab_size: 100 is less than the tokenizer's 512 tokens"),
    ],
)
def test_a_bad_value_names_its_key(recipe: str, override: str, message: str):
    with pytest.raises(UsageError) as caught:
        _check(recipe, f"model.config.{override}")
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


def test_two_values_that_only_fail_together_are_both_named():
    """BERT's hidden size must be a multiple of its head count: neither value is wrong on its own."""
    with pytest.raises(UsageError) as caught:
        _check("tiny-bert-classification", "model.config.num_attention_heads=5")
    text = str(caught.value)
    assert text.startswith("model.config.hidden_size: 128 with model.config.num_attention_heads: 5 cannot build")
    assert "not a multiple of the number of attention heads" in text


def test_good_values_build_the_config_and_sizes():
    config, dims = _check("tiny-llama-clm", "model.config.hidden_size=128", "model.config.vocab_size=600")
    assert (config.hidden_size, config.vocab_size, dims.hidden) == (128, 600, 128)
    config, dims = _check("tiny-bert-classification")
    assert config.vocab_size == 512 and config.num_labels == 2 and dims.is_encoder


def test_special_ids_outside_the_vocabulary_become_the_tokenizers():
    """Phi-3's class defaults (pad and eos 32000) with a 512-token tokenizer: the tokenizer's pad id, no eos;
    one the recipe sets itself is refused."""
    config, _ = _check("tiny-llama-clm", "model.config.model_type=phi3")
    assert config.pad_token_id == 0 and config.eos_token_id is None and config.bos_token_id == 1
    with pytest.raises(UsageError, match="model.config.pad_token_id: 600 is outside the vocabulary of 512 tokens"):
        _check("tiny-llama-clm", "model.config.model_type=phi3", "model.config.pad_token_id=600")
