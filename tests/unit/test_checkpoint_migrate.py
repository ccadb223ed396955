"""HF / torch / DDP / FSDP / DCP checkpoints <-> NxD per-rank shards: bit-identical round trips, the sharding
rules (GQA replication, fused QKV, pipeline stages), logits, optimizer state, and bad input."""

import json
import os

import pytest
import torch
from checkpoint_models import HEAD_DIM, HEADS, HIDDEN, KV, LAYERS, VOCAB, bert, hf_tensors, llama, rank_file

from neurontrain.checkpoint.migrate import MigrateOptions, migrate, open_checkpoint
from neurontrain.checkpoint.verify import compare, logits_diff
from neurontrain.errors import UsageError
from neurontrain.parallel.rules import ShardingSpec, kv_heads_of_rank, query_heads_of_rank


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("pp", [1, 2])
def test_llama_gqa_round_trip_is_bit_identical(tmp_path, tp, fuse, pp):
    _, src = llama(tmp_path)
    nxd, back = tmp_path / "nxd", tmp_path / "back"
    migrate(src, nxd, MigrateOptions(to="neuron", tp=tp, pp=pp, fuse_qkv=fuse))
    migrate(nxd, back, MigrateOptions(to="gpu"))
    original, restored = hf_tensors(src), hf_tensors(back)
    assert original.keys() == restored.keys()
    for name in original:
        assert torch.equal(original[name], restored[name]), name
    assert (nxd / "done").is_file() and json.loads((nxd / "checkpoint_spec.json").read_text())["tp"] == tp

    # shard shapes follow the rules
    q_rows, kv_rows = HEADS // tp * HEAD_DIM, max(1, KV // tp) * HEAD_DIM
    for p in range(pp):
        shard = rank_file(nxd, 0, p)
        first_layer = p * (LAYERS // pp)
        attn = f"model.layers.{first_layer}.self_attn"
        if fuse:
            assert shard[f"{attn}.qkv_proj.weight_qkv"].shape == (q_rows + 2 * kv_rows, HIDDEN)
        else:
            assert shard[f"{attn}.qkv_proj.weight_q"].shape == (q_rows, HIDDEN)
            assert shard[f"{attn}.qkv_proj.weight_k"].shape == (kv_rows, HIDDEN)
        assert shard[f"{attn}.o_proj.weight"].shape == (HIDDEN, q_rows)
        assert shard[f"model.layers.{first_layer}.mlp.gate_up_proj.weight"].shape == (2 * 128 // tp, HIDDEN)
        assert shard[f"model.layers.{first_layer}.mlp.down_proj.weight"].shape == (HIDDEN, 128 // tp)
        assert shard[f"model.layers.{first_layer}.input_layernorm.weight"].shape == (HIDDEN,)
        assert ("model.embed_tokens.weight" in shard) == (p == 0)
        assert ("lm_head.weight" in shard) == (p == pp - 1)
        assert not any(f"layers.{i}." in k for k in shard for i in range(LAYERS) if i // (LAYERS // pp) != p)
    if pp == 1:
        assert rank_file(nxd, 0, 0)["model.embed_tokens.weight"].shape == (VOCAB // tp, HIDDEN)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_each_rank_computes_its_part_of_attention(tmp_path, tp):
    """Sum over ranks of (local GQA attention with the rank's q/k/v/o shards) equals full attention: a rank's
    query heads really are the ones that use its KV head."""
    model, src = llama(tmp_path)
    nxd = tmp_path / "nxd"
    migrate(src, nxd, MigrateOptions(to="neuron", tp=tp))
    full = hf_tensors(src)
    torch.manual_seed(1)
    x = torch.randn(3, 5, HIDDEN)

    def attention(wq, wk, wv, wo, n_q, n_kv):
        q = (x @ wq.T).view(3, 5, n_q, HEAD_DIM).transpose(1, 2)
        k = (x @ wk.T).view(3, 5, n_kv, HEAD_DIM).transpose(1, 2).repeat_interleave(n_q // n_kv, dim=1)
        v = (x @ wv.T).view(3, 5, n_kv, HEAD_DIM).transpose(1, 2).repeat_interleave(n_q // n_kv, dim=1)
        out = torch.softmax(q @ k.transpose(-1, -2) / HEAD_DIM**0.5, dim=-1) @ v
        return out.transpose(1, 2).reshape(3, 5, n_q * HEAD_DIM) @ wo.T

    a = "model.layers.1.self_attn"
    expected = attention(
        full[f"{a}.q_proj.weight"],
        full[f"{a}.k_proj.weight"],
        full[f"{a}.v_proj.weight"],
        full[f"{a}.o_proj.weight"],
        HEADS,
        KV,
    )
    total = torch.zeros_like(expected)
    for r in range(tp):
        s = rank_file(nxd, r, 0)
        total += attention(
            s[f"{a}.qkv_proj.weight_q"],
            s[f"{a}.qkv_proj.weight_k"],
            s[f"{a}.qkv_proj.weight_v"],
            s[f"{a}.o_proj.weight"],
            HEADS // tp,
            max(1, KV // tp),
        )
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


def test_gqa_head_placement_matches_neuron():
    spec = ShardingSpec("llama", 4, 1, 2, 8, 2, 8, 128)
    assert [query_heads_of_rank(spec, r) for r in range(4)] == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert [kv_heads_of_rank(spec, r) for r in range(4)] == [[0], [1], [0], [1]]


@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_after_round_trip_and_tied_embeddings(tmp_path, tied):
    _, src = llama(tmp_path, tied=tied)
    assert ("lm_head.weight" in hf_tensors(src)) == (not tied)
    nxd, back = tmp_path / "nxd", tmp_path / "back"
    migrate(src, nxd, MigrateOptions(to="neuron", tp=4, pp=2, fuse_qkv=True))
    migrate(nxd, back, MigrateOptions(to="gpu"))
    spec = json.loads((nxd / "checkpoint_spec.json").read_text())
    assert spec["tied_embeddings"] == tied
    a, b = open_checkpoint(src), open_checkpoint(back)
    config = json.loads((src / "config.json").read_text())
    assert logits_diff(a, b, config) <= 1e-5
    assert logits_diff(a, open_checkpoint(nxd), config) <= 1e-5  # the sharded checkpoint read directly
    assert compare(a, open_checkpoint(nxd))["equal"]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_bert_round_trip_and_logits(tmp_path, tp):
    _, src = bert(tmp_path)
    nxd, back = tmp_path / "nxd", tmp_path / "back"
    migrate(src, nxd, MigrateOptions(to="neuron", tp=tp))
    migrate(nxd, back, MigrateOptions(to="gpu"))
    assert compare(open_checkpoint(src), open_checkpoint(back))["equal"]
    shard = rank_file(nxd, 0, 0)
    assert shard["bert.encoder.layer.0.attention.self.query.weight"].shape == (HIDDEN // tp, HIDDEN)
    assert shard["bert.encoder.layer.0.attention.output.dense.weight"].shape == (HIDDEN, HIDDEN // tp)
    assert shard["bert.encoder.layer.0.attention.output.dense.bias"].shape == (HIDDEN,)
    config = json.loads((src / "config.json").read_text())
    assert logits_diff(open_checkpoint(src), open_checkpoint(back), config) <= 1e-5


def test_ddp_fsdp_and_dcp_inputs_migrate(tmp_path, monkeypatch):
    import copy
    import socket

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType
    from torch.nn.parallel import DistributedDataParallel

    model, src = llama(tmp_path)
    reference = open_checkpoint(src)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    with socket.socket() as s:  # a free port, and set for this test only: a later process would inherit it
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        torch.save({"model": ddp.state_dict(), "epoch": 3}, tmp_path / "ddp.pt")
        assert next(iter(ddp.state_dict())).startswith("module.")
        fsdp = FullyShardedDataParallel(copy.deepcopy(model), device_id=torch.device("cpu"))
        with FullyShardedDataParallel.state_dict_type(
            fsdp, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        ):
            torch.save(fsdp.state_dict(), tmp_path / "fsdp.pt")
    finally:
        dist.destroy_process_group()
    for name, path in (("ddp", tmp_path / "ddp.pt"), ("fsdp", tmp_path / "fsdp.pt"), ("dcp", tmp_path / "dcp")):
        nxd, back = tmp_path / f"{name}-nxd", tmp_path / f"{name}-back"
        migrate(path, nxd, MigrateOptions(to="neuron", tp=2, config=src))
        migrate(nxd, back, MigrateOptions(to="gpu"))
        result = compare(reference, open_checkpoint(back))
        assert result["equal"], (name, result["differing"][:2], result["missing_in_b"], result["extra_in_b"])


def test_optimizer_state_round_trips(tmp_path):
    model, src = llama(tmp_path)
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "train.pt")
    nxd, back = tmp_path / "nxd", tmp_path / "back"
    migrate(
        tmp_path / "train.pt",
        nxd,
        MigrateOptions(to="neuron", tp=4, pp=2, fuse_qkv=True, with_optimizer=True, config=src),
    )
    shard = torch.load(nxd / "optim" / "dp_rank_00_tp_rank_01_pp_rank_00.pt", weights_only=True)
    fused = shard["model.layers.0.self_attn.qkv_proj.weight_qkv"]
    assert fused["exp_avg"].shape == (2 * HEAD_DIM + 2 * HEAD_DIM, HIDDEN) and float(fused["step"]) == 2.0
    migrate(nxd, back, MigrateOptions(to="gpu", with_optimizer=True))
    restored = torch.load(back / "optimizer.pt", weights_only=True)
    by_name = dict(zip(restored["param_groups"][0]["param_names"], restored["param_groups"][0]["params"]))
    names = [n for n, _ in model.named_parameters()]
    original = optimizer.state_dict()
    for i, name in enumerate(names):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(original["state"][i][moment], restored["state"][by_name[name]][moment]), name


def test_dtype_casts(tmp_path):
    _, src = llama(tmp_path)
    nxd, back = tmp_path / "nxd", tmp_path / "back"
    migrate(src, nxd, MigrateOptions(to="neuron", tp=2, dtype="bf16"))
    assert all(t.dtype == torch.bfloat16 for t in rank_file(nxd, 1, 0).values())
    migrate(nxd, back, MigrateOptions(to="gpu", dtype="fp32"))
    original, restored = hf_tensors(src), hf_tensors(back)
    for name in original:
        assert restored[name].dtype == torch.float32
        assert torch.equal(restored[name], original[name].to(torch.bfloat16).float())


def test_non_divisible_tp_and_wrong_tp_are_clear_errors(tmp_path):
    _, src = llama(tmp_path)
    with pytest.raises(UsageError, match="not divisible by --tp 3"):
        migrate(src, tmp_path / "x", MigrateOptions(to="neuron", tp=3))
    with pytest.raises(UsageError, match="not a multiple of the 2 KV heads|not divisible"):
        migrate(src, tmp_path / "y", MigrateOptions(to="neuron", tp=16))
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.partial*"))
    migrate(src, tmp_path / "nxd", MigrateOptions(to="neuron", tp=4))
    with pytest.raises(UsageError, match="--tp 2 does not match the checkpoint, which is sharded tp 4"):
        migrate(tmp_path / "nxd", tmp_path / "z", MigrateOptions(to="gpu", tp=2))


def test_bad_files_exit_2_with_one_line_and_leave_no_destination(tmp_path, capsys):
    """Through the CLI's entry point, in this process (the exit code and stderr are what a shell sees)."""
    from neurontrain.cli import main

    _, src = llama(tmp_path)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    data = (src / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    (truncated / "config.json").write_text((src / "config.json").read_text())
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(os.urandom(4096))
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello")
    (tmp_path / "exists").mkdir()
    cases = [
        (["migrate", str(truncated), str(tmp_path / "d1"), "--to", "neuron", "--tp", "2"], "safetensors"),
        (["migrate", str(corrupt), str(tmp_path / "d2"), "--to", "neuron", "--config", str(src)], "not a readable"),
        (["migrate", str(foreign), str(tmp_path / "d3"), "--to", "neuron", "--config", str(src)], "not a readable"),
        (["migrate", str(tmp_path / "missing"), str(tmp_path / "d4"), "--to", "gpu"], "does not exist"),
        (["migrate", str(src), str(tmp_path / "exists"), "--to", "neuron"], "exists (use --overwrite"),
        (["migrate", str(src), str(tmp_path / "d5"), "--to", "neuron", "--tp", "0"], "--tp must be at least 1"),
        (["verify", str(src), str(tmp_path / "missing")], "does not exist"),
        (
            ["migrate", str(src), str(tmp_path / "d6"), "--to", "neuron", "--pad-vocab-to-multiple-of", "0"],
            "--pad-vocab-to-multiple-of must be at least 1",
        ),
        (
            ["migrate", str(src), str(tmp_path / "d7"), "--to", "gpu", "--pad-vocab-to-multiple-of", "8"],
            "applies to --to neuron",
        ),
    ]
    capsys.readouterr()  # drop the set-up's progress bars
    for args, message in cases:
        code = main(["checkpoint", *args])
        stderr = capsys.readouterr().err
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2, (args, stderr[-1500:])
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in stderr, (args, stderr[-1500:])
    assert not any((tmp_path / d).exists() for d in ("d1", "d2", "d3", "d4", "d5", "d6", "d7"))
    assert not list(tmp_path.glob(".d*.partial*"))


def test_toolkit_training_checkpoint_with_optimizer(tmp_path, recipes):
    """A checkpoint as `neurontrain run` writes it (AdamW grouped by weight decay, indices without names)."""
    from neurontrain.loop.checkpoints import save_checkpoint
    from neurontrain.loop.optim import build_optimizer, materialize_optimizer_state
    from neurontrain.model.build import build_model
    from neurontrain.plan.planning import make_plan
    from neurontrain.recipe import load_recipe

    recipe = load_recipe(recipes / "tiny-llama-clm.yaml", [])
    plan = make_plan(recipe, "eager")
    model = build_model(recipe, plan.config)
    optimizer = build_optimizer(recipe, model)
    materialize_optimizer_state(optimizer)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    out = tmp_path / "run"
    model.save_pretrained(out / "model")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "data_position": 1}
    save_checkpoint(out / "checkpoints", 1, state, {"step": 1}, 2, torch.save, True)
    nxd, back = tmp_path / "nxd", tmp_path / "back"
    migrate(out, nxd, MigrateOptions(to="neuron", tp=2, with_optimizer=True))
    migrate(nxd, back, MigrateOptions(to="gpu", with_optimizer=True))
    restored = torch.load(back / "optimizer.pt", weights_only=True)
    index = dict(zip(restored["param_groups"][0]["param_names"], restored["param_groups"][0]["params"]))
    named = dict(model.named_parameters())
    for param, moments in optimizer.state.items():
        name = next(n for n, p in named.items() if p is param)
        assert torch.equal(moments["exp_avg"], restored["state"][index[name]]["exp_avg"]), name


def test_sharded_hf_output_and_input(tmp_path):
    _, src = llama(tmp_path)
    nxd, back, again = tmp_path / "nxd", tmp_path / "back", tmp_path / "again"
    migrate(src, nxd, MigrateOptions(to="neuron", tp=2))
    migrate(nxd, back, MigrateOptions(to="gpu", max_shard_bytes=64 << 10))
    index = json.loads((back / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in back.glob("*.safetensors")) == files
    migrate(back, again, MigrateOptions(to="neuron", tp=2))  # the sharded HF directory as input
    assert compare(open_checkpoint(src), open_checkpoint(again))["equal"]


def test_a_failure_mid_migration_leaves_no_destination(tmp_path):
    """The first pipeline stage is written, the second stage's shard is truncated: nothing appears at DST."""
    _, src = llama(tmp_path)
    nxd = tmp_path / "nxd"
    migrate(src, nxd, MigrateOptions(to="neuron", tp=2, pp=2))
    victim = nxd / "model" / "dp_rank_00_tp_rank_01_pp_rank_01.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(UsageError, match="not a readable torch checkpoint"):
        migrate(nxd, tmp_path / "out", MigrateOptions(to="gpu", max_shard_bytes=16 << 10))
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
