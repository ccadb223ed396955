"""Tensor parallel 2 on XLA:CPU: two real torchrun workers running `run` against the NxD stand-in
(tests/standin/nxd: NxD's interface, each layer holding only its rank's shard, collectives over gloo) train
tiny Llama (GQA: 8 query heads, 2 KV heads) with the same losses as one unsharded worker, each starting from
its own rank file of migrate's TP 2 shards, and write checkpoints in NxD's per-rank layout that merge back to
the unsharded run's weights. The starting weights are not the ones the recipe's seed gives: a run that ignored
them would not agree."""

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import RECIPES, REPO, read_json, read_metrics, run_cli

from neurontrain.checkpoint.migrate import MigrateOptions, migrate
from neurontrain.checkpoint.nxd import NxdReader
from neurontrain.model.build import build_model
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe

pytestmark = pytest.mark.slow

LLAMA = str(RECIPES / "tiny-llama-clm.yaml")
STANDIN = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "standin" / "nxd"), os.environ.get("PYTHONPATH", "")])}
SETTINGS = ["train.log_every=1", "train.schedule.warmup_steps=1", "train.max_steps=3", "checkpoint.every=2"]
SETTINGS += ["data.train_samples=64", "data.max_length=64", "data.buckets=[64]", "train.max_grad_norm=0.1"]
SETTINGS += ["data.packing=off"]  # the tensor-parallel workers and the one-worker reference: the same batches
ARGS = [
    "--no-preflight",
    *(arg for setting in SETTINGS for arg in ("--set", setting)),
]  # max_grad_norm: every step clips
TP2 = ["--nproc-per-node", "2", "--set", "parallel.tp=2"]


def _run(out: Path, *args: str, env: dict | None = None) -> dict[int, float]:
    result = run_cli("run", LLAMA, "-o", str(out), *ARGS, *args, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def _starting_weights(root: Path) -> tuple[Path, Path]:
    """The recipe's model with the weights of another seed, in Hugging Face format and as migrate's TP 2 shards."""
    plan = make_plan(load_recipe(LLAMA, [*SETTINGS, "train.seed=123"]), "xla-cpu")
    hf, shards = root / "start_hf", root / "start_tp2"
    build_model(plan.recipe, plan.config).save_pretrained(str(hf))
    migrate(hf, shards, MigrateOptions(to="neuron", tp=2))
    return hf, shards


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tp")
    hf, shards = _starting_weights(root)
    with ThreadPoolExecutor(max_workers=1) as pool:
        sharded = pool.submit(_run, root / "tp2", *TP2, "--init-from", str(shards), env=STANDIN)
        plain = _run(root / "tp1", "--init-from", str(hf))
        return {"root": root, "tp1": plain, "tp2": sharded.result()}


def _worst(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in b)


def test_tp2_from_rank_files_trains_like_one_unsharded_worker(runs):
    worst = _worst(runs["tp2"], runs["tp1"])
    print(f"TP 2 vs unsharded: worst relative loss difference over 3 steps {worst:.2e}")
    assert worst < 1e-5 and runs["tp1"][3] < runs["tp1"][1]
    sharded, plain = read_json(runs["root"] / "tp2" / "summary.json"), read_json(runs["root"] / "tp1" / "summary.json")
    assert abs(sharded["eval_loss"] - plain["eval_loss"]) < 1e-5 * plain["eval_loss"]


def test_tp2_checkpoint_is_nxd_layout_of_the_same_weights(runs):
    """Each TP rank's file holds its shards under NxD's names (fused gate_up, qkv_proj.weight_q/k/v); merged by
    the reader `checkpoint migrate --to gpu` uses, they are the unsharded run's weights at that step."""
    root = runs["root"]
    step = root / "tp2" / "checkpoints" / "step_00000003"
    rank0 = torch.load(step / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    assert rank0["model.layers.0.mlp.gate_up_proj.weight"].shape == (128, 64)  # gate and up, 64 rows each
    assert rank0["model.layers.0.self_attn.qkv_proj.weight_k"].shape == (8, 64)  # 1 of 2 KV heads
    merged = NxdReader(step)
    plain = torch.load(root / "tp1" / "checkpoints" / "step_00000003" / "state.pt", weights_only=False)["model"]
    assert sorted(merged.keys()) == sorted(plain)
    worst = max(float((merged.get(n) - plain[n]).abs().max()) for n in plain)
    print(f"TP 2 checkpoint vs unsharded weights after 3 steps: largest difference {worst:.1e}")
    assert worst < 1e-3  # AdamW steps of lr 3e-3: a wrong shard or merge is off by the weights' own size
    assert merged.optimizer_state() is not None
    assert not (root / "tp2" / "model").exists()  # no Hugging Face export of shards


def test_tp2_restart_resumes_from_each_ranks_own_files(runs, tmp_path):
    """The TP run restarted after step 2 (its step-3 checkpoint gone) loads each rank's shards and AdamW state
    back from its own files and ends at the same step-3 loss and shards, bit for bit."""
    first, again = runs["root"] / "tp2", tmp_path / "tp2"
    shutil.copytree(first, again)
    shutil.rmtree(again / "checkpoints" / "step_00000003")
    (again / "summary.json").unlink()
    losses = _run(again, *TP2, "--init-from", str(runs["root"] / "start_tp2"), env=STANDIN)
    assert read_json(again / "summary.json")["resumed_from_step"] == 2
    assert losses[3] == runs["tp2"][3]
    for rank in range(2):
        name = f"dp_rank_00_tp_rank_{rank:02d}_pp_rank_00.pt"
        for part in ("model", "optim"):
            a, b = (torch.load(d / "checkpoints" / "step_00000003" / part / name) for d in (first, again))
            assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a), (rank, part)


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
