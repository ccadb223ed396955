"""Sharding rules derived from transformers' own tensor-parallel plans, and the model facts a spec needs read
through transformers' config classes (so `n_head`, `dim` and other per-family names resolve through the config's
`attribute_map`).

A config class's `base_model_tp_plan` maps module patterns of the base model (`layers.*.self_attn.q_proj`) to a
style; the patterns are prefixed with the model class's `base_model_prefix` (`model.`, `gpt_neox.`; optional, so
a bare base model matches too). Styles become rules (see rules.py):
  colwise, colwise_gather_output   column (the bias follows the weight); a module named qkv_proj holds q|k|v
                                   rows (`qkv_packed`), one named gate_up_proj gate|up rows (`gate_up_packed`)
  packed_colwise                   gate_up_packed (Mixtral's 3-D experts.gate_up_proj: dim 1)
  rowwise, rowwise_split_input     row (the last dim; 3-D experts.down_proj: dim 2); the bias replicated
  embedding_rowwise                vocab
  replicated_*                     replicate
  moe_tp_experts                   (a module hook, no tensor)
Whatever the plan says for them, modules named q_proj/k_proj/v_proj/o_proj/gate_proj/up_proj keep Neuron's
layout: the GQA-aware q, k, v, o rules and gate/up fused into gate_up_proj. The input and output embeddings
(embed_tokens, lm_head, embed_in, embed_out, wte) are vocabulary-split; every other tensor is replicated, as
transformers leaves it. Families without a plan take the hand-written tables of rule_tables.py.
"""

from __future__ import annotations

import functools
import re

from neurontrain.errors import UsageError
from neurontrain.fact_cache import read_fact, write_fact
from neurontrain.parallel.rule_tables import HAND_RULES, TRAINING_REFUSALS

_LEAF_RULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up"}
_LEAF_BIAS = {"o_proj": "replicate"}
_PACKED_LEAVES = {"qkv_proj": "qkv_packed", "gate_up_proj": "gate_up_packed"}
_VOCAB = r"(^|\.)(embed_tokens|lm_head|embed_in|embed_out|wte)\.weight$"
_GATHERED = ("colwise_gather_output", "rowwise_split_input")


def config_object(config: dict):
    """The transformers config object of a config dict (attribute_map and defaults apply)."""
    import transformers  # lazy: seconds to import

    values = {k: v for k, v in config.items() if k not in ("transformers_version", "model_type")}
    try:
        return transformers.AutoConfig.for_model(config.get("model_type", ""), **values)
    except (ValueError, KeyError) as exc:
        raise UsageError(f"model type {config.get('model_type')!r}: transformers does not know it ({exc})") from None


@functools.lru_cache(maxsize=32)
def tp_plan(model_type: str) -> tuple[str, dict[str, str]] | None:
    """(base_model_prefix, base_model_tp_plan) of the model type, or None when its config has no plan. The
    prefix is a class attribute of the modeling module, whose import takes a second: kept in the fact cache."""
    stored = read_fact("tp-plan", model_type)
    if stored is None:
        found = _tp_plan_of(model_type)
        stored = {"found": list(found) if found else None}
        write_fact("tp-plan", model_type, stored)
    return (stored["found"][0], dict(stored["found"][1])) if stored["found"] else None


def _tp_plan_of(model_type: str) -> tuple[str, dict[str, str]] | None:
    import transformers  # lazy: seconds to import
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # lazy: as above
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES  # lazy: as above

    if model_type not in CONFIG_MAPPING:
        return None
    plan = getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None)
    base = getattr(transformers, MODEL_MAPPING_NAMES.get(model_type, ""), None)
    if not plan or base is None:
        return None
    return base.base_model_prefix, dict(plan)


def _plan_rules(prefix: str, plan: dict[str, str]) -> list[tuple[str, str]]:
    rules = []
    for key, style in plan.items():
        if style == "moe_tp_experts":
            continue
        leaf = key.rsplit(".", 1)[-1]
        module = rf"^({re.escape(prefix)}\.)?" + re.escape(key).replace(r"\*", r"\d+")
        if leaf in _LEAF_RULES:
            weight = _LEAF_RULES[leaf]
            bias = _LEAF_BIAS.get(leaf, weight)
        elif style.startswith("colwise") and leaf in _PACKED_LEAVES or style == "packed_colwise":
            weight = bias = _PACKED_LEAVES.get(leaf, "gate_up_packed")
        elif style.startswith("colwise"):
            weight = bias = "column"
        elif style.startswith("rowwise"):
            weight, bias = "row", "replicate"
        elif style == "embedding_rowwise":
            weight = bias = "vocab"
        elif style.startswith("replicated"):
            weight = bias = "replicate"
        else:
            raise UsageError(f"transformers' tensor-parallel plan style {style!r} ({key}) is not supported")
        rules += [(module + r"(\.weight)?$", weight), (module + r"\.bias$", bias)]
    return rules


@functools.lru_cache(maxsize=32)
def _resolved(model_type: str) -> tuple[tuple[str, str], ...] | None:
    if model_type in HAND_RULES:
        return tuple(HAND_RULES[model_type])
    found = tp_plan(model_type)
    if found is None:
        return None
    leaves = [(rf"(^|\.){leaf}\.weight$", rule) for leaf, rule in _LEAF_RULES.items()]
    leaves += [(rf"(^|\.){leaf}\.bias$", _LEAF_BIAS.get(leaf, rule)) for leaf, rule in _LEAF_RULES.items()]
    return tuple([(_VOCAB, "vocab"), *_plan_rules(*found), *leaves, (r".", "replicate")])


def resolve_rules(model_type: str) -> list[list[str]] | None:
    """The (pattern, rule) pairs of a model type, from its transformers plan or its hand-written table; None
    for a family with neither."""
    rules = _resolved(model_type)
    return [list(pair) for pair in rules] if rules is not None else None


def training_refusal(model_type: str) -> str | None:
    """Why NxD tensor-parallel training here cannot follow the family's plan, or None: a plan that gathers the
    output of an attention projection (Phi-3's fused qkv_proj, OLMo 2's q/k/v normalised over all heads) needs
    the whole projection on every rank; hand-ruled families whose attention cannot run a rank's heads."""
    if model_type in TRAINING_REFUSALS:
        return TRAINING_REFUSALS[model_type]
    found = tp_plan(model_type)
    if found is None:
        return None
    for key, style in found[1].items():
        if style in _GATHERED and key.rsplit(".", 1)[-1] in (*_LEAF_RULES, *_PACKED_LEAVES):
            return f"transformers' plan for {model_type} gathers {key} ({style}), which NxD's layers here do not"
    return None
