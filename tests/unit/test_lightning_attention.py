"""A Hugging Face model inside a LightningModule gets attention masks that are always built (no `mask.all()` read
on the host before attention), through transformers' public attention registries, with the same outputs."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, bidirectional_mask_function

from neurontrain.lightning.attention import NAME, static_masks


def _mask(implementation: str, attention_mask: torch.Tensor):
    return ALL_MASK_ATTENTION_FUNCTIONS[implementation](
        batch_size=2, q_length=6, kv_length=6, mask_function=bidirectional_mask_function,
        attention_mask=attention_mask.bool(), allow_is_bidirectional_skip=True,
    )  # fmt: skip


def test_the_model_is_switched_and_its_mask_is_built_even_without_padding():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)  # fmt: skip
    module = torch.nn.Module()
    module.model = BertForSequenceClassification(config).eval()
    ids, mask = torch.randint(1, 50, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    before = module.model(input_ids=ids, attention_mask=mask).logits
    assert static_masks(module) == ["model"]
    assert module.model.config._attn_implementation == NAME
    after = module.model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
    no_padding = torch.ones(2, 6, dtype=torch.long)
    assert _mask("sdpa", no_padding) is None  # control: SDPA's mask is dropped after reading it on the host
    assert _mask(NAME, no_padding) is not None
    assert static_masks(module) == []  # already switched
    assert static_masks(torch.nn.Linear(2, 2)) == []  # no Hugging Face model: nothing to do
