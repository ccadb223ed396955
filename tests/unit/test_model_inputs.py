"""How the loop calls a model (model/inputs.py): pure decisions from what the model accepts, and the set-up's
checks of tiny models on eager CPU (model/input_probe.py) for the cases the issue named."""

import pytest
import torch
from families import tiny_config
from packing_models import CLS, documents, pack, tiny_model

from neurontrain.model.build import static_experts
from neurontrain.model.input_probe import probe_model_inputs
from neurontrain.model.inputs import MASK_2D, MASK_4D, ModelFacts, ModelInputs, decide_inputs, sliding_window_of
from neurontrain.model.packed import packed_classification

DECODER = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache", "labels"})
ENCODER = frozenset({"input_ids", "attention_mask", "position_ids", "token_type_ids", "labels"})


def _facts(**kw) -> ModelFacts:
    base = {"model_type": "x", "causal": True, "forward_params": DECODER, "mask_4d_equivalent": True}
    return ModelFacts(**(base | {"packed_equivalent": True} | kw))


def test_a_causal_lm_keeps_the_2d_mask_and_turns_the_cache_off():
    inputs = decide_inputs(_facts())
    assert inputs.mask == MASK_2D and inputs.use_cache and inputs.position_ids and inputs.unpackable is None
    no_cache = decide_inputs(_facts(forward_params=DECODER - {"use_cache"}))
    assert not no_cache.use_cache


def test_an_encoder_gets_the_4d_mask_only_where_it_is_equivalent():
    bert = decide_inputs(_facts(causal=False, forward_params=ENCODER, has_packed_head=True))
    assert bert.mask == MASK_4D and not bert.use_cache and bert.token_type_ids and bert.unpackable is None
    deberta = decide_inputs(_facts(causal=False, forward_params=ENCODER, mask_4d_equivalent=False))
    assert deberta.mask == MASK_2D and "does not honour a 4D" in deberta.unpackable


def test_packing_needs_positions_equivalence_and_for_an_encoder_a_head():
    assert "position_ids" in decide_inputs(_facts(forward_params=DECODER - {"position_ids"})).unpackable
    assert "outputs it has alone" in decide_inputs(_facts(packed_equivalent=False)).unpackable
    no_head = decide_inputs(_facts(causal=False, forward_params=ENCODER))
    assert "no per-document classification head" in no_head.unpackable


def test_the_sliding_window_counts_only_where_a_layer_uses_it():
    assert sliding_window_of({"sliding_window": 4096}, None) == 4096
    assert sliding_window_of({"sliding_window": 4096}, ["full_attention", "sliding_attention"]) == 4096
    assert sliding_window_of({"sliding_window": 4096}, ["full_attention"]) is None
    assert sliding_window_of({"sliding_window": 4096, "use_sliding_window": False}, None) is None
    assert sliding_window_of({"sliding_window": None}, None) is None


def test_a_mask_is_2d_or_4d():
    with pytest.raises(ValueError, match="mask"):
        ModelInputs(mask="3d")


@pytest.mark.parametrize(
    ("model_type", "task", "mask", "unpackable"),
    [
        ("mistral", "causal-lm", MASK_2D, None),
        ("bert", "sequence-classification", MASK_4D, None),
        ("deberta-v2", "sequence-classification", MASK_2D, "does not honour a 4D"),
    ],
)
def test_the_set_up_checks_decide_per_family(model_type, task, mask, unpackable):
    inputs = probe_model_inputs(tiny_config(model_type, vocab_size=128, pad_token_id=0), task, "eager")
    assert inputs.mask == mask and inputs.use_cache == (task == "causal-lm")
    assert (inputs.unpackable is None) if unpackable is None else (unpackable in inputs.unpackable)


def test_roberta_packs_with_positions_after_its_pad_id():
    inputs = probe_model_inputs(tiny_config("roberta", vocab_size=128, pad_token_id=1), "sequence-classification", None)
    assert inputs.unpackable is None and inputs.position_offset == 2


def test_a_mixture_of_experts_gets_static_shaped_experts_on_xla():
    from transformers import AutoModelForCausalLM  # lazy: seconds to import

    mixtral = AutoModelForCausalLM.from_config(tiny_config("mixtral"))
    static_experts(mixtral, "eager")
    assert mixtral.config._experts_implementation == "grouped_mm"
    static_experts(mixtral, "xla-cpu")
    assert mixtral.config._experts_implementation == "batched_mm"
    static_experts(AutoModelForCausalLM.from_config(tiny_config("llama")), "xla-cpu")  # no experts: nothing to set


def test_packed_classification_runs_the_models_own_forward():
    """The module the native backend compiles is the model itself: the packed path calls it, not its encoder."""
    model = tiny_model("roberta")
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(module))
    tokens, labels = documents()
    out = packed_classification(model, pack(tokens, labels, CLS).batch, torch.float32, position_offset=1)
    assert calls == [model] and out.logits.shape[-1] == 3 and torch.isfinite(out.loss)
