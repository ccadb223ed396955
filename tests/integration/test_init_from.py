"""`run --init-from`: a run started from migrate's NxD shards is the run started from the Hugging Face weights,
and a run started from shards that carry AdamW's state (`migrate --with-optimizer`) continues its moments, each
ZeRO-1 worker its chunks."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from conftest import RECIPES, cli_in_process, read_json, read_metrics, run_cli
from safetensors.torch import load_file

from neurontrain.loop.checkpoints import load_rank_files
from neurontrain.parallel.zero1_state import chunk

SHORT = ["--set", "train.max_steps=3", "--set", "train.schedule.warmup_steps=1", "--set", "train.log_every=1"]
SHORT += ["--set", "checkpoint.every=0", "--set", "train.eval_at_end=false"]  # losses and weights are compared
RECIPE = str(RECIPES / "tiny-llama-clm.yaml")
ONE_STEP = ["--set", "train.max_steps=1", "--set", "checkpoint.every=1", "--set", "checkpoint.save_final=false"]
ONE_STEP += ["--set", "train.eval_at_end=false", "--set", "train.schedule.warmup_steps=0"]


def _run(out: Path, *args: str) -> list[float]:
    result = run_cli("run", RECIPE, "--output-dir", str(out), "--no-preflight", *SHORT, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def test_nxd_shards_start_the_run_bit_identical_to_the_hf_weights(tmp_path: Path, capsys):
    # the pre-training run keeps its last checkpoint (weights and AdamW state)
    _run(tmp_path / "pretrain", "--set", "checkpoint.every=3")
    hf_dir = tmp_path / "pretrain" / "model"
    nxd = tmp_path / "nxd"
    # in this process: migrate is torch alone, no XLA runtime (one process start less)
    migrate = ["checkpoint", "migrate", str(tmp_path / "pretrain"), str(nxd), "--to", "neuron", "--tp", "2"]
    code, _, err = cli_in_process(capsys, *migrate, "--with-optimizer")
    assert code == 0, err[-2000:]
    assert (nxd / "optim").is_dir()

    with ThreadPoolExecutor(max_workers=2) as pool:
        from_hf, from_nxd = pool.map(
            lambda args: _run(*args),
            [
                (tmp_path / "from_hf", "--init-from", str(hf_dir)),
                (tmp_path / "from_nxd", "--init-from", str(nxd), "--init-from-weights-only"),
            ],
        )
    fresh = [r["loss"] for r in read_metrics(tmp_path / "pretrain" / "metrics.jsonl") if "loss" in r]
    assert from_hf == from_nxd and len(from_hf) == 3
    assert from_hf[0] < fresh[0]  # the run really started from the trained weights
    a = load_file(str(tmp_path / "from_hf" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "from_nxd" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)

    _moments_continue(tmp_path, nxd)


def _one_step(out: Path, nxd: Path, *args: str) -> None:
    result = run_cli("run", RECIPE, "-o", str(out), "--no-preflight", "--init-from", str(nxd), *ONE_STEP, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "initial optimizer state: AdamW moments of" in result.stderr
    summary = read_json(out / "summary.json")
    assert summary["unexpected_graphs"] == 0 and summary["hidden_host_syncs"] == []


def _gradient_pair(moments: dict, m0: torch.Tensor, v0: torch.Tensor, betas: list[float]) -> tuple:
    """AdamW's first step from (m0, v0) left m1 = b1 m0 + (1 - b1) g and v1 = b2 v0 + (1 - b2) g^2: g^2 recovered
    from each, which agree only if the step really started from m0 and v0."""
    b1, b2 = betas
    m1, v1 = moments["exp_avg"].double(), moments["exp_avg_sq"].double()
    return ((m1 - b1 * m0.double()) / (1 - b1)) ** 2, (v1 - b2 * v0.double()) / (1 - b2)


def _moments_continue(tmp_path: Path, nxd: Path) -> None:
    """One step from the shards with their AdamW state, on two ZeRO-1 workers and on one replicated worker: each
    worker's moments after the step are the source's (its chunks, under ZeRO-1) advanced by one AdamW step, and
    the step count goes on from the source's."""
    zero1, replicated = tmp_path / "zero1", tmp_path / "replicated"
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(
            pool.map(
                lambda args: _one_step(*args),
                [(zero1, nxd, "--nproc-per-node", "2", "--set", "train.zero1=true"), (replicated, nxd)],
            )
        )
    source = torch.load(tmp_path / "pretrain" / "checkpoints" / "step_00000003" / "state.pt", weights_only=False)
    source = source["optimizer"]["state"]  # numbered in group order, as both runs' optimizers
    step_dir = "checkpoints/step_00000001"
    plain = torch.load(replicated / step_dir / "state.pt", weights_only=False)["optimizer"]
    ranks = load_rank_files(zero1 / step_dir, [0, 1])
    worst = 0.0
    for i, src in source.items():
        cases = [(plain["state"][i], plain["param_groups"], src["exp_avg"], src["exp_avg_sq"])]
        cases += [
            (r["base_state"][i], r["param_groups"], chunk(src["exp_avg"], 2, k), chunk(src["exp_avg_sq"], 2, k))
            for k, r in enumerate(ranks)
        ]
        for moments, groups, m0, v0 in cases:
            assert float(moments["step"]) == float(src["step"]) + 1 == 4.0
            from_m, from_v = _gradient_pair(moments, m0, v0, groups[0]["betas"])
            scale = float(from_v.abs().max()) or 1.0
            worst = max(worst, float((from_m - from_v).abs().max()) / scale)
    print(f"g^2 from the first and the second moment: worst difference {worst:.1e} of the largest")
    assert worst < 1e-4


def test_missing_init_from_is_one_line_exit_2(tmp_path: Path, capsys):
    path = tmp_path / "nowhere"
    code, _, err = cli_in_process(
        capsys, "run", RECIPE, "--output-dir", str(tmp_path / "out"), "--init-from", str(path)
    )
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"neurontrain: error: --init-from {path} does not exist"
