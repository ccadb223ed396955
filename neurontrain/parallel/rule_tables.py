"""Hand-written sharding rules, for the families whose transformers config carries no tensor-parallel plan
(`base_model_tp_plan`), and the tables specs written before rules were stored in them are read with.

Each table is a list of (pattern, rule) over Hugging Face parameter names; the first match wins (rules.py lists
the rules). GPT-2's `Conv1D` layers hold their weight as (in, out): a column split is on dim 1 there
(`conv1d_column`; `c_attn` fuses q|k|v along its output, `conv1d_qkv`) and a row split on dim 0 (`conv1d_row`).
"""

from __future__ import annotations

LLAMA_RULES: list[tuple[str, str]] = [
    (r"(^|\.)embed_tokens\.weight$", "vocab"),
    (r"(^|\.)lm_head\.weight$", "vocab"),
    (r"\.self_attn\.q_proj\.weight$", "q"),
    (r"\.self_attn\.k_proj\.weight$", "k"),
    (r"\.self_attn\.v_proj\.weight$", "v"),
    (r"\.self_attn\.o_proj\.weight$", "o"),
    (r"\.mlp\.gate_proj\.weight$", "gate"),
    (r"\.mlp\.up_proj\.weight$", "up"),
    (r"\.mlp\.down_proj\.weight$", "row"),
    (r"norm\.weight$", "replicate"),
]

BERT_RULES: list[tuple[str, str]] = [
    (r"embeddings\.word_embeddings\.weight$", "vocab"),
    (r"embeddings\.(position_embeddings|token_type_embeddings)\.weight$", "replicate"),
    (r"attention\.self\.(query|key|value)\.(weight|bias)$", "column"),
    (r"attention\.output\.dense\.weight$", "row"),
    (r"intermediate\.dense\.(weight|bias)$", "column"),
    (r"layer\.\d+\.output\.dense\.weight$", "row"),
    (r"LayerNorm\.(weight|bias)$", "replicate"),
    (r"(attention\.output|layer\.\d+\.output)\.dense\.bias$", "replicate"),
    (r"(pooler|classifier|cls)\..*$", "replicate"),
]

ROBERTA_RULES = BERT_RULES  # the same modules under `roberta.`; its classifier head (dense, out_proj) replicated

DISTILBERT_RULES: list[tuple[str, str]] = [
    (r"embeddings\.word_embeddings\.weight$", "vocab"),
    (r"embeddings\.position_embeddings\.weight$", "replicate"),
    (r"attention\.(q_lin|k_lin|v_lin)\.(weight|bias)$", "column"),
    (r"attention\.out_lin\.weight$", "row"),
    (r"ffn\.lin1\.(weight|bias)$", "column"),
    (r"ffn\.lin2\.weight$", "row"),
    (r"(attention\.out_lin|ffn\.lin2)\.bias$", "replicate"),
    (r"(LayerNorm|layer_norm)\.(weight|bias)$", "replicate"),
    (r"(^|\.)(pre_classifier|classifier|vocab_transform|vocab_layer_norm|vocab_projector|qa_outputs)\.", "replicate"),
]

DEBERTA_V2_RULES: list[tuple[str, str]] = [
    (r"embeddings\.word_embeddings\.weight$", "vocab"),
    (r"embeddings\.(position_embeddings|token_type_embeddings|embed_proj)\.weight$", "replicate"),
    (r"attention\.self\.(query_proj|key_proj|value_proj|pos_key_proj|pos_query_proj)\.(weight|bias)$", "column"),
    (r"attention\.output\.dense\.weight$", "row"),
    (r"intermediate\.dense\.(weight|bias)$", "column"),
    (r"layer\.\d+\.output\.dense\.weight$", "row"),
    (r"(attention\.output|layer\.\d+\.output)\.dense\.bias$", "replicate"),
    (r"LayerNorm\.(weight|bias)$", "replicate"),
    (r"encoder\.(rel_embeddings|conv)\.", "replicate"),
    (r"(^|\.)(pooler|classifier|cls|lm_predictions)\..*$", "replicate"),
]

GPT2_RULES: list[tuple[str, str]] = [
    (r"(^|\.)(wte|lm_head)\.weight$", "vocab"),
    (r"(^|\.)wpe\.weight$", "replicate"),
    (r"\.attn\.c_attn\.(weight|bias)$", "conv1d_qkv"),
    (r"\.mlp\.c_fc\.(weight|bias)$", "conv1d_column"),
    (r"\.(attn|mlp)\.c_proj\.weight$", "conv1d_row"),
    (r"\.(attn|mlp)\.c_proj\.bias$", "replicate"),
    (r"(^|\.)(ln_1|ln_2|ln_f)\.(weight|bias)$", "replicate"),
    (r"(^|\.)score\.weight$", "replicate"),
]

# families without a transformers plan
HAND_RULES = {
    "bert": BERT_RULES,
    "roberta": ROBERTA_RULES,
    "distilbert": DISTILBERT_RULES,
    "deberta-v2": DEBERTA_V2_RULES,
    "gpt2": GPT2_RULES,
}
# what a checkpoint_spec.json without a `rules` field (written before rules were stored) was sharded by
LEGACY_FAMILIES = {"llama": LLAMA_RULES, "mistral": LLAMA_RULES, "qwen2": LLAMA_RULES, "bert": BERT_RULES}
# hand-ruled families whose modules cannot run one rank's heads (NxD tensor-parallel training refuses them)
TRAINING_REFUSALS = {
    "deberta-v2": "DeBERTa-v2's attention reshapes by the config's head count, not the heads a rank holds",
}
