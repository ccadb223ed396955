"""The model families users bring, as tiny models built from each transformers config class with its own
defaults: only the sizes are made small (hidden 64, 2 layers, 4 heads, 2 KV heads where the family has them,
head_dim 16 where the config names one); everything else (sliding windows, biases, norms, tied embeddings,
activation functions) stays as the config class sets it. No hub: nothing is downloaded.

`FAMILIES` is the one parameter list of the per-family tests and of the README's table of families
(`python tests/families.py` prints it; tests/unit/test_families_table.py checks README.md and
docs/model-families.md hold it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CLM, CLS = "causal-lm", "sequence-classification"


@dataclass(frozen=True)
class Family:
    model_type: str  # transformers' model_type (the config class's)
    task: str
    name: str  # as the README names it
    packs: bool = True  # data.packing trains it (per-document isolation proven); else refused in one line
    # NxD tensor-parallel training: "run" (trained end to end through NxD's layers: the stand-in's test),
    # "layers" (NxD's layers chosen for every sharded weight; not trained end to end), else the refusal's words
    tp_training: str = "layers"


FAMILIES: tuple[Family, ...] = (
    Family("llama", CLM, "Llama", tp_training="run"),
    Family("mistral", CLM, "Mistral"),
    Family("mixtral", CLM, "Mixtral (MoE)"),  # transformers 5.25: experts in the EP plan, replicated under TP
    Family("qwen2", CLM, "Qwen2"),
    Family("qwen3", CLM, "Qwen3"),
    Family("gemma2", CLM, "Gemma 2"),
    Family("gemma3_text", CLM, "Gemma 3 (text)"),
    Family("phi3", CLM, "Phi-3", tp_training="gathers layers.*.self_attn.qkv_proj"),
    Family("olmo2", CLM, "OLMo 2", tp_training="gathers layers.*.self_attn.q_proj"),
    Family("gpt_neox", CLM, "GPT-NeoX / Pythia"),
    Family("granite", CLM, "Granite"),
    Family("gpt2", CLM, "GPT-2", tp_training="c_attn.weight is sharded by rule 'conv1d_qkv'"),
    Family("bert", CLS, "BERT", tp_training="run"),
    Family("roberta", CLS, "RoBERTa"),
    Family("distilbert", CLS, "DistilBERT"),
    Family("deberta-v2", CLS, "DeBERTa-v2", packs=False, tp_training="reshapes by the config's head count"),
)
BY_TYPE = {family.model_type: family for family in FAMILIES}
DECODERS = tuple(f.model_type for f in FAMILIES if f.task == CLM)
ENCODERS = tuple(f.model_type for f in FAMILIES if f.task == CLS)

# native tensor parallel at TP 2 against one eager worker: these in the suite (tests/integration/test_native_tp.py),
# the other families by `python benchmarks/native_tp.py families`, whose output the table reads
NATIVE_TP_SUITE = ("llama", "qwen3", "mistral")
NATIVE_TP_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "native_tp_families.json"

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 2, 4, 2, 16, 128


def tiny_config_values(model_type: str) -> dict:
    """`model.config` values of a tiny model of this family: the config class's defaults with small sizes."""
    from transformers import AutoConfig  # lazy: seconds to import

    defaults = AutoConfig.for_model(model_type)
    values = {"model_type": model_type, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS}
    values["num_attention_heads"] = HEADS
    if hasattr(defaults, "intermediate_size"):
        values["intermediate_size"] = INTERMEDIATE
    if hasattr(defaults, "hidden_dim"):  # DistilBERT's name for it
        values["hidden_dim"] = INTERMEDIATE
    if getattr(defaults, "num_key_value_heads", None) is not None:
        values["num_key_value_heads"] = KV_HEADS
    if getattr(defaults, "head_dim", None) is not None:
        values["head_dim"] = HEAD_DIM
    if getattr(defaults, "num_local_experts", None) is not None:
        values["num_local_experts"] = 4
    return values


def tiny_config(model_type: str, **overrides):
    """The transformers config object of `tiny_config_values` (with `overrides`)."""
    from transformers import AutoConfig  # lazy: seconds to import

    values = {**tiny_config_values(model_type), **overrides}
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _tp_training(family: Family) -> str:
    if family.tp_training == "run":
        return "yes: trained through NxD's layers (stand-in)"
    if family.tp_training == "layers":
        return "NxD layers chosen for every sharded weight; not trained end to end"
    return f"refused: …{family.tp_training}…"


def _native_tp_training(family: Family, results: dict) -> str:
    """The "TP training (native)" cell: from tests/integration/test_native_tp.py (NATIVE_TP_SUITE) or from the
    output of `python benchmarks/native_tp.py families` (NATIVE_TP_RESULTS)."""
    if family.model_type in NATIVE_TP_SUITE:
        return "yes: TP 2 = 1-worker eager within 1e-5, 20 steps (suite)"
    row = results.get(family.model_type)
    if row is None:
        return "not run"
    if not row["trained"]:
        if "no base_model_tp_plan" in row["error"]:
            return "refused in one line: no transformers TP plan"
        return f"fails: {row['error'].removeprefix('neurontrain: error: ')}"
    ok = row["max_relative_loss_difference"] <= 1e-5 and row["loss_fell"] and row["unexpected_graphs"] == 0
    verdict = "yes" if ok else "NO"
    return (
        f"{verdict}: TP 2 vs 1-worker eager {row['max_relative_loss_difference']:.0e}, {row['steps']} steps (benchmark)"
    )


def readme_table() -> str:
    """The README's table of families: what the per-family tests assert for each."""
    results = json.loads(NATIVE_TP_RESULTS.read_text()) if NATIVE_TP_RESULTS.exists() else {}
    rows = [
        "| family (`model_type`) | task | `run` on XLA:CPU, config defaults | `data.packing` | "
        "`checkpoint migrate` TP 2 and back | tensor-parallel training (NxD) | TP training (native) |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in FAMILIES:
        packing = "yes, per-document isolation tested" if f.packs else "refused in one line"
        cells = [f"{f.name} (`{f.model_type}`)", f.task, "yes", packing, "yes, bit-identical", _tp_training(f)]
        rows.append("| " + " | ".join([*cells, _native_tp_training(f, results)]) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(readme_table())
