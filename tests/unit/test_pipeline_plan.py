"""The planner's pipeline layouts: the stage split, the bubble, in-flight micro-batches, and a Llama 3 70B (its
config's shapes, written out) on trn1 x 16 and trn2 x 8."""

import pytest

from neurontrain.parallel.memory import Config, ModelShape, Param, Workload, resolve_target
from neurontrain.parallel.memory_choice import Pins, pipeline_candidates, plan_memory
from neurontrain.parallel.pipeline_memory import (
    bubble,
    in_flight,
    micro_batches,
    pipeline_estimate,
    split_params,
    stage_layers,
)

# meta-llama/Meta-Llama-3-70B config.json
H, FF, LAYERS, HEADS, KV, D, V = 8192, 28672, 80, 64, 8, 128, 128256


def llama(layers: int = LAYERS, tied: bool = False) -> ModelShape:
    params = [Param("model.embed_tokens.weight", (V, H), False)]
    for i in range(layers):
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
    params += [Param("model.norm.weight", (H,), False), Param("lm_head.weight", (V, H), True)]
    return ModelShape(
        family="llama", task="causal-lm", params=tuple(params), layers=layers, hidden=H, heads=HEADS, kv_heads=KV,
        head_dim=D, intermediate=FF, vocab=V, labels=2, attention="eager", tied_embeddings=tied,
    )  # fmt: skip


def test_stage_split_bubble_and_in_flight():
    assert stage_layers(80, 8) == [10] * 8
    assert stage_layers(10, 4) == [2, 3, 3, 2]  # leftovers to the middle stages first
    assert stage_layers(5, 2) == [2, 3]
    with pytest.raises(ValueError):
        stage_layers(2, 3)
    assert bubble(8, 512) == pytest.approx(7 / 519)
    assert bubble(1, 4) == 0.0
    assert [in_flight(s, 4, 16) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert in_flight(3, 4, 16, "gpipe") == 16
    work = Workload(batch=1, length=8192, precision="bf16", world=512, step_samples=1024)
    assert micro_batches(work, Config(zero1=False, checkpointing="full", tp=32, pp=8)) == 512
    assert (
        micro_batches(
            Workload(batch=2, length=8, precision="fp32", world=4, grad_accum=3),
            Config(zero1=False, checkpointing="none"),
        )
        == 3
    )


def test_embeddings_go_first_head_last():
    stages = split_params(llama(4).params, [2, 2])
    assert stages[0][0].name == "model.embed_tokens.weight"
    assert {p.name.split(".")[2] for p in stages[0][1:]} == {"0", "1"}
    assert [p.name for p in stages[1][-2:]] == ["model.norm.weight", "lm_head.weight"]
    assert sum(map(len, stages)) == len(llama(4).params)


@pytest.mark.parametrize(("target", "pp"), [("trn1", 4), ("trn2", 2)])
def test_llama3_70b_gets_a_fitting_pipeline_layout(target, pp):
    """512 cores (trn1 x 16: 32 a node; trn2 x 8: 64 logical a node), 8,192 tokens, bf16, 1,024 samples a
    step. TP alone (up to 64) does not fit; TP 32 x PP `pp` does, with the references' layout fitting too."""
    core, _ = resolve_target(target, None, "neuron")
    work = Workload(batch=1, length=8192, precision="bf16", world=512, step_samples=1024)
    plan = plan_memory(llama(), work, core, Pins(fsdp=False), tp_available=True, enforced=True)
    config = plan.choice.config
    assert plan.fits and (config.tp, config.pp, config.sequence_parallel) == (32, pp, True)
    assert not any(e.fits for e in plan.tried if e.config.pp == 1)
    described = plan.describe()["pipeline"]
    assert described["pp"] == pp and described["micro_batches"] == 1024 // (512 // (32 * pp))
    assert described["bubble"] == round((pp - 1) / (described["micro_batches"] + pp - 1), 4)
    assert len(described["stages"]) == pp and described["stages"][0]["embeddings"] and described["stages"][-1]["head"]
    assert "stage0:L0-" in plan.table()
    reference = Config(zero1=False, checkpointing="full", tp=32, pp=pp * 2, sequence_parallel=True)
    assert pipeline_estimate(llama(), work, reference, core).fits  # the references' PP 8 (trn1) / PP 4 (trn2)
    first, last = plan.choice.stages[0], plan.choice.stages[-1]
    assert first.bytes["logits"] == 0 < last.bytes["logits"]
    assert first.in_flight == pp and last.in_flight == 1


def test_tied_embeddings_get_no_pipeline_and_pinned_pp_only_pipelines():
    assert pipeline_candidates(llama(4, tied=True), 8, Pins(), True, native=True) == []
    pinned = pipeline_candidates(llama(4), 8, Pins(pp=2, tp=1), False, native=True)
    assert {(c.pp, c.tp, c.sequence_parallel) for c in pinned} == {(2, 1, False)}
    assert pipeline_candidates(llama(4), 8, Pins(pp=1), True, native=False) == []
