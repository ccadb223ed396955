"""Every model family of tests/families.py through `checkpoint migrate --to neuron --tp 2` and back: the rules
come from transformers' tensor-parallel plans (decoders) or the hand tables (encoders, GPT-2); the round trip is
bit-identical and the logits equal (Mixtral's per-expert tensors, as save_pretrained writes them, merged as
transformers merges them on load). Phi-3's fused qkv_proj and gate_up_proj shard as a Llama's q/k/v and
gate/up do; a family without rules is refused naming itself and its first tensor."""

import json
import re

import pytest
import torch
from conftest import cli_in_process
from families import CLM, FAMILIES, tiny_config
from safetensors.torch import load_file

from neurontrain.checkpoint import converted, matching
from neurontrain.checkpoint.initial import load_initial_weights
from neurontrain.checkpoint.matching import loaded_names
from neurontrain.checkpoint.migrate import MigrateOptions, migrate
from neurontrain.checkpoint.nxd import NxdReader
from neurontrain.checkpoint.report import inspect_checkpoint
from neurontrain.errors import UsageError
from neurontrain.parallel.memory import Config, ModelShape, Param, Workload, estimate, resolve_target, sharding_spec
from neurontrain.parallel.rules import ShardingSpec, piece_of, rule_for, spec_from_config
from neurontrain.parallel.tensor_parallel import check_trainable, model_spec, parallel_layers

VOCAB = 96
IDS = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def save_tiny(path, model_type: str, task: str = CLM, **overrides):
    """A seeded tiny random model of the family, saved with save_pretrained; the model."""
    import transformers  # lazy: seconds to import

    torch.manual_seed(0)
    cls = transformers.AutoModelForCausalLM if task == CLM else transformers.AutoModelForSequenceClassification
    model = cls.from_config(tiny_config(model_type, **(IDS | overrides)))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("family", FAMILIES, ids=[f.model_type for f in FAMILIES])
def test_family_round_trip_through_tp2_is_bit_identical(tmp_path, capsys, family):
    src, nxd, back = tmp_path / "hf", tmp_path / "nxd", tmp_path / "back"
    model = save_tiny(src, family.model_type, family.task)
    for args in ((src, nxd, "--to", "neuron", "--tp", "2"), (nxd, back, "--to", "gpu")):
        code, _, err = cli_in_process(capsys, "checkpoint", "migrate", *map(str, args))
        assert code == 0, err
    spec = json.loads((nxd / "checkpoint_spec.json").read_text())
    assert spec["rules"] and spec["family"] == family.model_type
    shards = NxdReader(nxd)  # the shapes it reports by arithmetic (merged_shape) are those of the merged tensors
    assert all(shards.meta(name) == (tuple(shards.get(name).shape), shards.get(name).dtype) for name in shards.keys())
    config = json.loads((src / "config.json").read_text())
    saved = load_file(str(src / "model.safetensors"))
    original = {name: saved[key] for name, key in loaded_names(list(saved), config).items()}
    if family.model_type == "mixtral":  # experts saved per expert, merged by transformers on load: the model's own
        original = model.state_dict()
    restored = load_file(str(back / "model.safetensors"))
    if family.model_type != "mixtral":  # the original's keys exactly, as save_pretrained wrote them (embed_out...)
        assert set(saved) == set(restored), set(saved) ^ set(restored)
    restored = {name: restored[key] for name, key in loaded_names(list(restored), config).items()}
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[name], restored[name]) for name in original)
    code, out, err = cli_in_process(capsys, "checkpoint", "verify", str(src), str(back), "--logits", str(src))
    assert code == 0 and out.rstrip().endswith("EQUAL"), out + err


def _rank(path, tp: int) -> dict:
    return torch.load(path / "model" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt", weights_only=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_phi3_fused_qkv_shards_hold_each_ranks_heads(tmp_path, tp):
    """A Phi-3 and a Llama with the same weights (qkv_proj's rows split into q, k, v; gate_up_proj's into gate,
    up): each rank's qkv_proj piece is the Llama rank's fused q|k|v, its gate_up_proj piece the Llama's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    phi3 = save_tiny(tmp_path / "phi3", "phi3")
    cfg = phi3.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            pad_token_id=0,
        )
    )
    q_rows, kv_rows = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    state = llama.state_dict()
    for name, tensor in phi3.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            parts = tensor.split([q_rows, kv_rows, kv_rows])
            for part, leaf in zip(parts, ("q_proj", "k_proj", "v_proj")):
                state[name.replace("qkv_proj", leaf)] = part
        elif name.endswith("gate_up_proj.weight"):
            gate, up = tensor.chunk(2)
            state[name.replace("gate_up_proj", "gate_proj")], state[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            state[name] = tensor
    llama.load_state_dict(state)
    llama.save_pretrained(tmp_path / "llama")
    migrate(tmp_path / "phi3", tmp_path / "p", MigrateOptions(to="neuron", tp=tp))
    migrate(tmp_path / "llama", tmp_path / "l", MigrateOptions(to="neuron", tp=tp, fuse_qkv=True))
    for rank in range(tp):
        p, ll = _rank(tmp_path / "p", rank), _rank(tmp_path / "l", rank)
        for layer in range(cfg.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            assert torch.equal(p[f"{prefix}.self_attn.qkv_proj.weight"], ll[f"{prefix}.self_attn.qkv_proj.weight_qkv"])
            assert torch.equal(p[f"{prefix}.mlp.gate_up_proj.weight"], ll[f"{prefix}.mlp.gate_up_proj.weight"])
            assert torch.equal(p[f"{prefix}.self_attn.o_proj.weight"], ll[f"{prefix}.self_attn.o_proj.weight"])


def test_gpt_neox_query_key_value_split_gives_whole_heads():
    """GPT-NeoX's query_key_value is per-head interleaved ([q_h | k_h | v_h] for each head h), so its contiguous
    row split (transformers' plan: colwise) gives each rank whole heads."""
    names = ["gpt_neox.layers.0.attention.query_key_value.weight"]
    config = tiny_config("gpt_neox", **IDS).to_dict()
    spec = spec_from_config(config, names, 2, 1, False, None)
    head_rows = 3 * spec.head_dim
    rule = rule_for(spec, names[0])
    for rank in range(2):
        piece = piece_of(spec, rule, (spec.num_heads * head_rows, 64), rank)
        assert rule == "column" and not piece.more
        assert piece.start % head_rows == 0 and (piece.stop - piece.start) == spec.num_heads // 2 * head_rows


def test_family_without_rules_is_refused_naming_it_and_its_first_tensor():
    with pytest.raises(UsageError, match=r"model type 'opt'.*first tensor without a rule: model.decoder.embed"):
        spec_from_config({"model_type": "opt"}, ["model.decoder.embed_tokens.weight"], 2, 1, False, None)
    with pytest.raises(UsageError, match=r"no sharding rule for gpt2 tensor 'transformer.h.0.attn.extra.weight'"):
        names = ["transformer.wte.weight", "transformer.h.0.attn.extra.weight"]
        spec_from_config(tiny_config("gpt2", **IDS).to_dict(), names, 2, 1, False, None)


def test_spec_without_rules_reads_with_the_legacy_tables():
    old = {"family": "llama", "tp": 2, "pp": 1, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    spec = ShardingSpec.from_json({**old, "vocab_size": 96})
    assert spec.rules is None and rule_for(spec, "model.layers.0.self_attn.k_proj.weight") == "k"


def test_mixtral_per_expert_checkpoints_migrate_as_transformers_merges_them(tmp_path, capsys, monkeypatch):
    """What save_pretrained writes (per-expert w1/w2/w3, merged by transformers' converters on load) migrates:
    the experts merged by those converters into gate_up_proj (experts, 2 x intermediate, hidden); sharded as
    transformers' plan says: up to 5.24 packed_colwise (each rank its gate and up rows of every expert) and
    down_proj (experts, hidden, intermediate) rowwise on its last dim; from 5.25 the experts are in the expert
    parallel plan only, so tensor parallel replicates them. Back to GPU, the fused tensors load with
    from_pretrained bit for bit and the logits are equal; the save_pretrained directory and the shards start a
    run (--init-from). A converter migrate does not apply is refused naming the tensor."""
    import transformers  # lazy: seconds to import

    src, nxd, back = tmp_path / "hf", tmp_path / "nxd", tmp_path / "back"
    model = save_tiny(src, "mixtral")
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in load_file(str(src / "model.safetensors"))
    report = inspect_checkpoint(src)
    assert "mapping_error" not in report and report["not_converted"] == 0
    layers, experts = model.config.num_hidden_layers, model.config.num_local_experts
    assert report["merged"] == 3 * layers * experts and report["merged_first"].endswith("mlp.experts.gate_up_proj")
    assert migrate(src, nxd, MigrateOptions(to="neuron", tp=2))["source"]["merged"] == 3 * layers * experts
    code, _, err = cli_in_process(capsys, "checkpoint", "migrate", str(nxd), str(back), "--to", "gpu")
    assert code == 0, err
    full, rank1 = model.state_dict(), _rank(nxd, 1)
    gate_up, down = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
    inter = full[down].shape[2]
    gate, up = full[gate_up].split(inter, dim=1)
    if "layers.*.mlp.experts.gate_up_proj" in transformers.MixtralConfig.base_model_tp_plan:  # up to 5.24
        assert torch.equal(rank1[gate_up], torch.cat([gate[:, inter // 2 :], up[:, inter // 2 :]], dim=1))
        assert torch.equal(rank1[down], full[down][:, :, inter // 2 :])
    else:  # 5.25 moved the experts to base_model_ep_plan: tensor parallel replicates them, as transformers does
        assert torch.equal(rank1[gate_up], full[gate_up]) and torch.equal(rank1[down], full[down])
    assert gate_up in load_file(str(back / "model.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back).state_dict()
    assert loaded.keys() == full.keys() and all(torch.equal(loaded[n], full[n]) for n in full)
    code, out, err = cli_in_process(capsys, "checkpoint", "verify", str(src), str(back), "--logits", str(src))
    assert code == 0 and out.rstrip().endswith("EQUAL"), out + err
    for start in (src, nxd):
        torch.manual_seed(1)
        fresh = type(model)(model.config)
        load_initial_weights(fresh, start)
        assert all(torch.equal(fresh.state_dict()[n], full[n]) for n in full)
    monkeypatch.setattr(converted, "supported", lambda converter: False)
    monkeypatch.setattr(matching, "supported", lambda converter: False)
    code, _, err = cli_in_process(capsys, "checkpoint", "migrate", str(src), str(tmp_path / "x"), "--to", "neuron")
    assert code == 2 and "block_sparse_moe.experts.0.w1.weight is one of the tensors transformers converts" in err


def test_mixtral_trainer_checkpoint_moments_follow_the_merged_experts(tmp_path):
    """A Trainer-style Mixtral checkpoint (save_pretrained's per-expert weights, optimizer.pt indexed in the
    model's parameter order, whose experts are fused): --with-optimizer takes every moment, experts included."""
    src = tmp_path / "hf"
    model = save_tiny(src, "mixtral")
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.tensor([[3, 4, 5, 6]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), src / "optimizer.pt")
    (src / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    migrate(src, tmp_path / "nxd", MigrateOptions(to="neuron", tp=2, with_optimizer=True))
    migrate(tmp_path / "nxd", tmp_path / "back", MigrateOptions(to="gpu", with_optimizer=True))
    restored = torch.load(tmp_path / "back" / "optimizer.pt", weights_only=True)
    group = restored["param_groups"][0]
    by_name = {name: restored["state"][i] for name, i in zip(group["param_names"], group["params"])}
    state = optimizer.state_dict()["state"]
    for i, (name, _) in enumerate(model.named_parameters()):
        assert all(torch.equal(by_name[name][m], state[i][m]) for m in ("exp_avg", "exp_avg_sq")), name


@pytest.mark.parametrize("family", FAMILIES, ids=[f.model_type for f in FAMILIES])
def test_which_families_nxd_tensor_parallel_training_takes(family):
    """NxD's layers (column, row, vocabulary) for every sharded weight, or a one-line refusal."""
    import transformers  # lazy: seconds to import

    cls = transformers.AutoModelForCausalLM if family.task == CLM else transformers.AutoModelForSequenceClassification
    with torch.device("meta"):
        model = cls.from_config(tiny_config(family.model_type, **IDS))
    spec = model_spec(model, 2)
    names = [name for name, _ in model.named_parameters()]
    expected = family.tp_training if family.tp_training not in ("run", "layers") else None
    shape = _model_shape(model, spec, family.task)
    planned = sharding_spec(shape, 2)  # the memory planner's TP candidates
    assert (planned is None) == (expected is not None)
    if expected is None:
        check_trainable(spec)
        layers = parallel_layers(spec, names)
        assert {layer.kind for layer in layers} <= {"vocab", "column", "row"} and len(layers) > 4
        work = Workload(batch=1, length=16, precision="bf16", world=2)
        target, _ = resolve_target("trn1", None, "neuron")
        assert estimate(shape, work, Config(zero1=False, checkpointing="none", tp=2), target).total
    else:
        with pytest.raises(UsageError, match=re.escape(expected)):
            check_trainable(spec)
            parallel_layers(spec, names)


def _model_shape(model, spec: ShardingSpec, task: str) -> ModelShape:
    params = tuple(Param(name, tuple(p.shape), p.dim() == 2) for name, p in model.named_parameters())
    sizes = {"layers": spec.num_layers, "hidden": model.config.hidden_size, "heads": spec.num_heads}
    sizes |= {"kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "intermediate": 128, "vocab": VOCAB}
    return ModelShape(family=spec.family, task=task, params=params, labels=2, attention="eager", **sizes)


def test_inspect_and_verify_take_transformers_renamed_names(tmp_path, capsys):
    """GPT-NeoX's save_pretrained writes `embed_out.weight`; transformers loads it as `lm_head.weight`."""
    src = tmp_path / "hf"
    save_tiny(src, "gpt_neox")
    assert "embed_out.weight" in load_file(str(src / "model.safetensors"))
    report = inspect_checkpoint(src)
    assert "mapping_error" not in report and report["not_converted"] == 0
    code, out, _ = cli_in_process(capsys, "checkpoint", "verify", str(src), str(src))
    assert code == 0 and out.rstrip().endswith("EQUAL")
    # from a GPU folder to a GPU folder, the source's own names
    migrate(src, tmp_path / "copy", MigrateOptions(to="gpu"))
    copied = load_file(str(tmp_path / "copy" / "model.safetensors"))
    assert set(copied) == set(load_file(str(src / "model.safetensors")))
