"""The memory planner's figures against hand arithmetic (Llama 3.2 1B, BERT-base), its targets, the order in
which it tries configurations, and its refusal."""

import pytest

from neurontrain.errors import UsageError
from neurontrain.model.build import build_config
from neurontrain.parallel.memory import GIB, MIB, Config, ModelShape, Param, Workload, estimate, resolve_target
from neurontrain.parallel.memory_choice import Pins, candidates, plan_memory, tp_degrees
from neurontrain.plan.memory_inputs import model_shape
from neurontrain.recipe import Recipe

TRN1, _ = resolve_target("trn1", None, "neuron")

# Llama 3.2 1B (meta-llama/Llama-3.2-1B config.json)
H, FF, LAYERS, HEADS, KV, D, V = 2048, 8192, 16, 32, 8, 64, 128256
LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": H,
    "intermediate_size": FF,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "head_dim": D,
    "vocab_size": V,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
}
LLAMA_N = V * H + LAYERS * (H * H + 2 * (KV * D) * H + H * H + 3 * FF * H + 2 * H) + H
LLAMA_NORMS = (2 * LAYERS + 1) * H  # the only parameters no matmul reads (the tied embedding feeds the LM head)

# BERT-base for sequence classification (2 labels)
BH, BI, BL, BHEADS, BV, BPOS = 768, 3072, 12, 12, 30522, 512
BERT_LAYER = 4 * (BH * BH + BH) + 2 * BH + (BI * BH + BI) + (BH * BI + BH) + 2 * BH
BERT_N = (BV + BPOS + 2) * BH + 2 * BH + BL * BERT_LAYER + (BH * BH + BH) + (2 * BH + 2)
BERT_LINEAR = BL * (4 * (BH * BH + BH) + (BI * BH + BI) + (BH * BI + BH)) + (BH * BH + BH) + (2 * BH + 2)


SIZES = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")


def shape(family: str, task: str, params: list, sizes: tuple, **extra) -> ModelShape:
    named = dict(zip(SIZES, sizes, strict=True))
    return ModelShape(family=family, task=task, params=tuple(params), labels=2, attention="eager", **named, **extra)


def llama_shape() -> ModelShape:
    params = [Param("model.embed_tokens.weight", (V, H), True)]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        params += [
            Param(p + "self_attn.q_proj.weight", (HEADS * D, H), True),
            Param(p + "self_attn.k_proj.weight", (KV * D, H), True),
            Param(p + "self_attn.v_proj.weight", (KV * D, H), True),
            Param(p + "self_attn.o_proj.weight", (H, HEADS * D), True),
            Param(p + "mlp.gate_proj.weight", (FF, H), True),
            Param(p + "mlp.up_proj.weight", (FF, H), True),
            Param(p + "mlp.down_proj.weight", (H, FF), True),
            Param(p + "input_layernorm.weight", (H,), False),
            Param(p + "post_attention_layernorm.weight", (H,), False),
        ]
    params.append(Param("model.norm.weight", (H,), False))
    return shape("llama", "causal-lm", params, (LAYERS, H, HEADS, KV, D, FF, V), tied_embeddings=True)


def bert_shape() -> ModelShape:
    e = "bert.embeddings."
    params = [
        Param(e + "word_embeddings.weight", (BV, BH), False),
        Param(e + "position_embeddings.weight", (BPOS, BH), False),
        Param(e + "token_type_embeddings.weight", (2, BH), False),
        Param(e + "LayerNorm.weight", (BH,), False),
        Param(e + "LayerNorm.bias", (BH,), False),
    ]
    for i in range(BL):
        p = f"bert.encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            params += [Param(p + name + ".weight", (BH, BH), True), Param(p + name + ".bias", (BH,), True)]
        params += [
            Param(p + "attention.output.LayerNorm.weight", (BH,), False),
            Param(p + "attention.output.LayerNorm.bias", (BH,), False),
            Param(p + "intermediate.dense.weight", (BI, BH), True),
            Param(p + "intermediate.dense.bias", (BI,), True),
            Param(p + "output.dense.weight", (BH, BI), True),
            Param(p + "output.dense.bias", (BH,), True),
            Param(p + "output.LayerNorm.weight", (BH,), False),
            Param(p + "output.LayerNorm.bias", (BH,), False),
        ]
    params += [
        Param("bert.pooler.dense.weight", (BH, BH), True),
        Param("bert.pooler.dense.bias", (BH,), True),
        Param("classifier.weight", (2, BH), True),
        Param("classifier.bias", (2,), True),
    ]
    sizes = (BL, BH, BHEADS, BHEADS, BH // BHEADS, BI, BV)
    return shape("bert", "sequence-classification", params, sizes, attention_dropout=0.1, hidden_dropout=0.1)


def test_parameter_counts_are_the_published_sizes():
    assert LLAMA_N == 1_235_814_400  # "1.24B" on the model card
    assert llama_shape().numel == LLAMA_N
    assert bert_shape().numel == BERT_N == 109_482_240 + (2 * BH + 2)  # BertModel's 109.48 M + the classifier


def test_llama_1b_dp_matches_hand_arithmetic():
    work = Workload(batch=1, length=2048, precision="bf16", world=1)
    got = estimate(llama_shape(), work, Config(zero1=False, checkpointing="none"), TRN1).bytes
    assert got["parameters"] == 4 * LLAMA_N
    assert got["gradients"] == 4 * LLAMA_N
    assert got["optimizer"] == 2 * 4 * LLAMA_N  # exp_avg + exp_avg_sq, fp32
    assert got["master"] == 0
    assert got["autocast"] == 2 * (LLAMA_N - LLAMA_NORMS)
    assert got["logits"] == 1 * 2048 * V * (2 + 4 + 4)  # bf16 logits, fp32 log-probabilities, fp32 gradient
    assert got["runtime"] == 96 * MIB + int(0.10 * 16 * GIB)
    per_token = 4 * 4 * H + 2 * 2 * H + 2 * (4 * HEADS * D + 4 * FF)
    scores = 1 * HEADS * 2048 * 2048 * (4 + 2)  # fp32 softmax output + its bf16 copy for the PV matmul
    assert got["activations"] == LAYERS * (1 * 2048 * per_token + scores)
    # the figure: weights, gradients and AdamW alone need 18.4 GiB
    assert round((got["parameters"] + got["gradients"] + got["optimizer"]) / GIB, 1) == 18.4


def test_llama_1b_zero1_at_32_workers_matches_hand_arithmetic():
    work = Workload(batch=1, length=2048, precision="bf16", world=32)
    got = estimate(llama_shape(), work, Config(zero1=True, checkpointing="full"), TRN1).bytes
    # every dim 0 (128256, 2048, 512, 8192) divides by 32: each worker's shard is exactly N / 32
    assert got["parameters"] == got["gradients"] == 4 * LLAMA_N
    assert got["optimizer"] == 8 * LLAMA_N // 32
    assert got["master"] == 4 * LLAMA_N // 32
    layer = 1 * 2048 * (4 * 4 * H + 2 * 2 * H + 2 * (4 * HEADS * D + 4 * FF)) + HEADS * 2048 * 2048 * 6
    assert got["activations"] == LAYERS * (1 * 2048 * H * 4) + layer  # kept inputs + one layer recomputing


def test_bert_base_matches_hand_arithmetic():
    work = Workload(batch=8, length=512, precision="fp32", world=1)
    got = estimate(bert_shape(), work, Config(zero1=False, checkpointing="none"), TRN1).bytes
    assert got["parameters"] == got["gradients"] == 4 * BERT_N
    assert got["optimizer"] == 8 * BERT_N
    assert got["master"] == got["autocast"] == 0
    assert got["logits"] == 8 * 2 * (4 + 4 + 4)
    per_token = 4 * 2 * BH + 4 * 2 * BH + 2 * BH + 4 * (4 * BH + 2 * BI)
    scores = 8 * BHEADS * 512 * 512 * (4 + 1 + 4)  # softmax, dropout mask, dropped probabilities
    assert got["activations"] == BL * (8 * 512 * per_token + scores)
    bf16 = estimate(
        bert_shape(),
        Workload(batch=8, length=512, precision="bf16", world=1),
        Config(zero1=False, checkpointing="none"),
        TRN1,
    )
    assert bf16.bytes["autocast"] == 2 * BERT_LINEAR
    assert bf16.bytes["logits"] == 8 * 2 * (2 + 4 + 4)


def test_bert_base_zero1_pads_dim0_to_the_world():
    work = Workload(batch=8, length=512, precision="fp32", world=4)
    got = estimate(bert_shape(), work, Config(zero1=True, checkpointing="none"), TRN1).bytes
    # 30522 word rows pad to 30524; token_type (2 x 768), classifier (2 x 768) and its bias (2) pad to 4 rows
    padded = BERT_N + (30524 - BV) * BH + 2 * BH + 2 * BH + 2
    assert got["optimizer"] == 8 * padded // 4
    assert got["master"] == 4 * padded // 4


def test_tensor_parallel_shards_by_the_migrate_rules():
    work = Workload(batch=1, length=2048, precision="bf16", world=2)
    got = estimate(llama_shape(), work, Config(zero1=False, checkpointing="none", tp=2), TRN1).bytes
    # everything but the norms halves (vocabulary 128256 divides by 2; 8 KV heads split 4 + 4)
    assert got["parameters"] == 4 * ((LLAMA_N - LLAMA_NORMS) // 2 + LLAMA_NORMS)
    assert got["logits"] == 2048 * (V // 2) * 10


def test_targets():
    assert TRN1.core_bytes == 16 * GIB
    assert resolve_target("trn2", None, "neuron")[0].core_bytes == 24 * GIB  # 96 GiB / 4 logical cores (LNC=2)
    assert resolve_target("trn2", None, "neuron", lnc=1)[0].core_bytes == 12 * GIB
    assert resolve_target("trn3", None, "neuron")[0].core_bytes == 36 * GIB  # 144 GiB / 4 logical cores
    assert resolve_target("trn1", 7.5, "neuron")[0].core_bytes == int(7.5 * GIB)
    target, notes = resolve_target("auto", None, "xla-cpu")
    assert target.name == "trn1" and "planned for trn1" in notes[0]
    target, notes = resolve_target("auto", None, "neuron")
    assert target.name == "trn1" and "known only once the runtime runs" in notes[0] and "not enforced" in notes[0]


def test_candidates_follow_dp_zero1_checkpointing_tp():
    model = llama_shape()
    got = [(c.zero1, c.checkpointing, c.tp) for c in candidates(model, 4, Pins(), tp_available=True)]
    assert got[:5] == [
        (False, "none", 1),
        (True, "none", 1),
        (True, "every_4", 1),
        (True, "every_2", 1),
        (True, "full", 1),
    ]
    assert got[5:7] == [(False, "none", 2), (False, "every_4", 2)]  # ZeRO-1 is not combined with TP
    assert not any(c[0] for c in got if c[2] > 1)
    assert {c[2] for c in got} == {1, 2, 4}
    assert [c[:2] for c in got if c[2] == 4][0] == (False, "none")  # one data-parallel worker: no ZeRO-1
    single = candidates(model, 1, Pins(), tp_available=False)
    assert [(c.zero1, c.checkpointing) for c in single] == [
        (False, "none"),
        (False, "every_4"),
        (False, "every_2"),
        (False, "full"),
    ]
    pinned = candidates(model, 4, Pins(zero1=False, checkpointing="full", tp=1), tp_available=True)
    assert pinned == [Config(zero1=False, checkpointing="full", tp=1)]
    assert tp_degrees(bert_shape(), 8) == [2, 4]  # 12 heads: 8 does not divide them


def test_plan_picks_the_first_fit_and_refuses_when_enforced():
    model = llama_shape()
    work = Workload(batch=1, length=320, precision="bf16", world=32)
    plan = plan_memory(model, work, TRN1, Pins(), tp_available=False, enforced=True)
    dp, zero1 = plan.tried
    assert dp.total > TRN1.core_bytes >= zero1.total
    assert plan.choice is zero1 and plan.fits
    plan.check()
    single = plan_memory(
        model, Workload(batch=1, length=320, precision="bf16", world=1), TRN1, Pins(), tp_available=False, enforced=True
    )
    assert not single.fits and single.choice.config.checkpointing == "full"
    assert "ZeRO-1 fits from" in single.advice and "parallel.tp 2" in single.advice
    with pytest.raises(UsageError, match="no configuration fits a 16.00 GiB trn1 core at 1 worker"):
        single.check()
    plan_memory(model, work, TRN1, Pins(zero1=False), tp_available=False, enforced=False).check()  # not enforced
    table = plan.table().splitlines()
    assert table[1].split() == ["GiB", "DP", "ZeRO-1"] and table[-1].split() == ["fits", "no", "yes"]


def test_model_shape_reads_the_meta_model():
    recipe = Recipe.model_validate(
        {
            "name": "l1b",
            "task": "causal-lm",
            "model": {"config": LLAMA_CONFIG},
            "tokenizer": {"word_level": {"vocab_size": 64}},
            "data": {"source": "synthetic-text", "max_length": 64, "batch_size": 1},
            "train": {"max_steps": 1, "optimizer": {"lr": 1e-4}},
        }
    )
    shape = model_shape(recipe, build_config(recipe, None))
    assert shape.numel == LLAMA_N
    assert (
        sum(p.shape[0] * (p.shape[1] if len(p.shape) > 1 else 1) for p in shape.params if p.matmul)
        == LLAMA_N - LLAMA_NORMS
    )
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab) == (LAYERS, HEADS, KV, D, V)
