"""Native data parallel, two torchrun workers (gloo here) against one eager worker on the same global batch: under
PyTorch's DistributedDataParallel, and sharded with FSDP2's `fully_shard`, both with the planned graphs only. A
FSDP2 worker killed with SIGKILL restarts from the DCP checkpoint and ends with the uninterrupted run's weights;
that checkpoint migrates to Hugging Face safetensors with the same weights and logits.

The one-worker reference is eager PyTorch on the same plan: test_native.py holds one native worker to eager
within 1e-4 at every step, and an eager run costs no compile."""

import shutil

import pytest
from conftest import RECIPES, cli_in_process, read_json, read_metrics, run_cli, run_killing_a_worker

pytestmark = pytest.mark.slow

STEPS, EVERY = 6, 3
COMMON = [
    str(RECIPES / "tiny-llama-clm.yaml"),
    "--no-preflight",
    *("--set", f"train.max_steps={STEPS}", "--set", "train.log_every=1"),
    *("--set", "train.precision=fp32", "--set", "model.config.attention_dropout=0.0"),
    *("--set", "train.eval_at_end=false", "--set", "train.schedule.warmup_steps=1"),
    *("--set", "data.packing=off"),  # the same global batch of samples on one worker and on two
]
DDP = ["--backend", "native", "--nproc-per-node", "2", "--set", "data.batch_size=8"]  # 8 rows a worker
FSDP = [*DDP, "--set", "parallel.fsdp=true"]
LAYERS = 2  # the tiny Llama's; each is an FSDP2 unit compiled on its own
WEIGHTS = "model/model.safetensors"


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One eager worker of 16 rows a step, two DDP workers of 8, two FSDP2 workers of 8 (checkpoints every EVERY
    steps)."""
    root = tmp_path_factory.mktemp("fsdp")
    eager = ["--backend", "eager", "--set", "data.batch_size=16", "--set", "checkpoint.every=0"]
    ddp = [*DDP, "--set", "checkpoint.every=0"]
    for name, extra in (("eager", eager), ("ddp", ddp), ("fsdp", [*FSDP, "--set", f"checkpoint.every={EVERY}"])):
        result = run_cli("run", *COMMON, *extra, "--output-dir", str(root / name))
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def _matches_eager(runs, name: str) -> dict:
    """Run `name`'s losses against the eager worker's at every step (within 1e-3, falling); its summary."""
    one, two = _losses(runs / "eager"), _losses(runs / name)
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    worst = max(abs(one[s] - two[s]) / abs(one[s]) for s in one)
    print(f"native {name} 2 workers vs 1 eager worker: largest relative loss difference {worst:.2e}")
    assert worst <= 1e-3
    assert two[STEPS] < two[1]
    summary = read_json(runs / name / "summary.json")
    assert (summary["backend"], summary["world_size"], summary["effective_batch"]) == ("native", 2, 16)
    return summary


def test_two_ddp_workers_match_one_worker_on_the_same_global_batch(runs):
    summary = _matches_eager(runs, "ddp")
    assert summary["unexpected_graphs"] == 0 and summary["compilations"] == summary["expected_graphs"] == 1


def test_two_fsdp_workers_match_one_worker_on_the_same_global_batch(runs):
    summary = _matches_eager(runs, "fsdp")
    # at most one graph per layer for the one planned train shape, nothing else (identical layers may share one
    # compiled graph since the model inputs are decided per model: TorchDynamo reuses it)
    assert summary["expected_graphs"] == LAYERS and 1 <= summary["compilations"] == summary["distinct_graphs"] <= LAYERS
    assert summary["unexpected_graphs"] == 0
    # each worker holds about half of every parameter, gradient and AdamW moment (dim-0 shards)
    whole = read_json(runs / "eager" / "summary.json")["device_bytes"][0]
    for worker in summary["device_bytes"]:
        for kind in ("parameters", "gradients", "optimizer"):
            assert 0.45 * whole[kind] <= worker[kind] <= 0.55 * whole[kind], (kind, worker, whole)


def test_sigkill_then_restart_ends_with_the_uninterrupted_weights(runs, tmp_path, capsys):
    out = tmp_path / "killed"
    args = ["run", *COMMON, *FSDP, "--set", f"checkpoint.every={EVERY}", "--max-restarts", "1", "-o", str(out)]
    code, stderr = run_killing_a_worker(args, out, EVERY)
    assert code == 0, stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["restarts"] == 1 and summary["resumed_from_step"] in (EVERY, STEPS)
    assert summary["unexpected_graphs"] == 0
    assert (out / WEIGHTS).read_bytes() == (runs / "fsdp" / WEIGHTS).read_bytes()

    shards = out / "checkpoints" / f"step_{STEPS:08d}" / "dcp"
    hf = tmp_path / "hf"
    # the checkpoint commands in this process (no torch-xla in them): the CLI's own process is tested elsewhere
    code, _, err = cli_in_process(capsys, "checkpoint", "migrate", str(shards), str(hf), "--to", "gpu")
    assert code == 0, err[-2000:]
    code, out, err = cli_in_process(
        capsys, "checkpoint", "verify", str(hf), str(runs / "fsdp" / "model"), "--logits", str(hf)
    )
    assert code == 0, out + err[-2000:]
    assert "max abs diff 0," in out and "logits max abs diff 0: EQUAL" in out


def test_an_fsdp_checkpoint_refuses_a_resume_without_fsdp(runs, tmp_path):
    """One native worker of the same global batch (no FSDP2) finds DCP shards where it expects a plain state: one line,
    exit 2, nothing of the checkpoint touched."""
    out = tmp_path / "one"
    step = out / "checkpoints" / f"step_{EVERY:08d}"
    shutil.copytree(runs / "fsdp" / "checkpoints" / f"step_{EVERY:08d}", step)
    before = sorted(p.name for p in step.rglob("*"))
    result = run_cli("run", *COMMON, "--backend", "native", "--set", "data.batch_size=16", "--output-dir", str(out))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "holds FSDP2 shards of 2 workers" in result.stderr
    assert sorted(p.name for p in step.rglob("*")) == before
