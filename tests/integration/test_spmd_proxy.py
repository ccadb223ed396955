"""The SPMD proxy for the tensor-parallel rules (CPU_NUM_DEVICES=4, tp 4): tiny Llama (8 query heads, 2 KV heads,
so KV heads are replicated and query heads permuted) and tiny BERT train sharded by the migrate rules within
1e-5 of the unsharded run, every device holds the piece `rules.shard` gives its rank, and wrong rules
are caught (two in one run: each parameter's pieces are checked on their own). One process per mode (SPMD mode
is process-global), all jobs of a mode in it."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import RECIPES, REPO

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("spmd_proxy_worker.py")
LLAMA, BERT = str(RECIPES / "tiny-llama-clm.yaml"), str(RECIPES / "tiny-bert-classification.yaml")
# A row-parallel weight split on the wrong dim; query heads split contiguously, ignoring Neuron's GQA permutation.
WRONG_DIM = "model.layers.0.mlp.down_proj.weight"
NO_PERMUTATION = "model.layers.1.self_attn.q_proj.weight"
SHARDED_JOBS = [LLAMA, BERT, f"{LLAMA}@{WRONG_DIM}=column,{NO_PERMUTATION}=column"]


def _worker(mode: str, jobs: list[str]) -> list[dict]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(WORKER), mode, *jobs], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def reports() -> dict:
    with ThreadPoolExecutor(max_workers=2) as pool:
        plain = pool.submit(_worker, "plain", [LLAMA, BERT])
        sharded = pool.submit(_worker, "sharded", SHARDED_JOBS)
        plain_llama, plain_bert = plain.result()
        llama, bert, wrong_rules = sharded.result()
    return {
        "plain": {"llama": plain_llama, "bert": plain_bert},
        "sharded": {"llama": llama, "bert": bert},
        "wrong_rules": wrong_rules,
    }


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_rules_as_sharding_train_like_the_unsharded_model(reports: dict, family: str):
    plain, sharded = reports["plain"][family]["losses"], reports["sharded"][family]["losses"]
    assert len(plain) == len(sharded) == 5 and plain[-1] < plain[0]
    assert max(abs(a - b) / abs(a) for a, b in zip(plain, sharded)) < 1e-5, (plain, sharded)
    report = reports["sharded"][family]
    assert report["mismatches"] == []
    split = [name for name, spec in report["specs"].items() if spec.startswith("{devices=")]
    assert len(split) > len(report["specs"]) // 2  # most parameters are split, norms are not
    assert all("norm" not in name.lower() for name in split)
    assert report["grad_specs"] == report["specs"]  # gradients kept across steps stay sharded like their weights


def test_gqa_layout_is_neurons(reports: dict):
    """tp 4 over 2 KV heads: K/V split over the kv axis and replicated over the copies; Q split in the order that
    puts on rank r the query heads of KV head r mod 2 (devices 0, 2, 1, 3 along the rows)."""
    specs = reports["sharded"]["llama"]["specs"]
    assert specs["model.layers.0.self_attn.k_proj.weight"] == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"
    assert specs["model.layers.0.self_attn.q_proj.weight"] == "{devices=[4,1]0,2,1,3}"
    assert specs["model.layers.0.self_attn.o_proj.weight"] == "{devices=[1,4]0,2,1,3}"
    assert specs["model.layers.0.mlp.gate_proj.weight"] == "{devices=[4,1]0,1,2,3}"


def test_a_wrong_rule_is_caught(reports: dict):
    """SPMD never changes the mathematics, so a wrong annotation trains the same losses: the placement check
    (each device's piece against `rules.shard`) is what catches it."""
    wrong = reports["wrong_rules"]
    assert wrong["losses"] == pytest.approx(reports["sharded"]["llama"]["losses"], rel=1e-5)
    # in parameter order, nothing else: the row-parallel weight split on the wrong dim is wrong on every rank;
    # contiguous query heads happen to be right on ranks 0 and 3 (Q0-1, Q6-7), wrong on 1 and 2
    wrong_dim = [f"{WRONG_DIM} on CPU:{r}" for r in range(4)]
    assert wrong["mismatches"] == wrong_dim + [f"{NO_PERMUTATION} on CPU:{r}" for r in (1, 2)]
