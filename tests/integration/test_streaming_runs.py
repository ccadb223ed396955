"""data.streaming on XLA:CPU, each run in its own process: a run over local JSON-lines shards, and the same
shards under an s3:// prefix on the local S3 server read by a run that is SIGKILLed right after a checkpoint
(its loader has read batches ahead of the step) and then resumed: the same weights, bit for bit, one train graph."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import RECIPES, REPO, read_json, read_metrics, run_cli
from safetensors.torch import load_file
from stream_shards import write_shards

from neurontrain.data.stream_source import list_shards, read_lines

pytestmark = pytest.mark.slow

STEPS, EVERY = 10, 4

KILL_AFTER_CHECKPOINT = f"""
import os, signal, sys
import neurontrain.loop.checkpoints as checkpoints
real_save = checkpoints.save_checkpoint
def save_then_die(root, step, *args, **kwargs):
    out = real_save(root, step, *args, **kwargs)
    if step == {EVERY}:
        os.kill(os.getpid(), signal.SIGKILL)  # the checkpoint is complete; the loader is batches ahead
    return out
checkpoints.save_checkpoint = save_then_die
from neurontrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _args(path: str, out: Path) -> list[str]:
    sets = [
        "data.streaming=true",
        "data.source=json",
        f"data.path={path}",
        "data.train_samples=null",
        "data.eval_samples=8",
        "data.max_length=64",
        "data.batch_size=4",
        f"train.max_steps={STEPS}",
        "train.log_every=1",
        f"checkpoint.every={EVERY}",
    ]
    return [
        "run",
        str(RECIPES / "tiny-llama-clm.yaml"),
        *(a for s in sets for a in ("--set", s)),
        "--no-preflight",
        "--output-dir",
        str(out),
    ]


def _s3_reads_as_local(prefix: str, paths: list[Path]) -> None:
    """The prefix's shards, read from any line's byte offset (a ranged GET) or from their end, as the files."""
    shards = list_shards(prefix)
    assert shards == [f"{prefix}{p.name}" for p in paths]  # README.txt is not a shard
    for remote, local in zip(shards, paths, strict=True):
        lines = list(read_lines(str(local)))
        assert list(read_lines(remote)) == lines
        record, byte, _, _ = lines[len(lines) // 2]
        assert list(read_lines(remote, byte, record)) == lines[record:]
        assert list(read_lines(remote, local.stat().st_size, len(lines))) == []


def test_streaming_run_killed_and_resumed_on_s3_matches_the_uninterrupted_local_run(tmp_path: Path, s3_bucket):
    bucket, client = s3_bucket
    paths = write_shards(tmp_path / "shards", shards=3, per_shard=40)
    for shard in paths:
        client.upload_file(str(shard), bucket, f"corpus/{shard.name}")
    client.put_object(Bucket=bucket, Key="corpus/README.txt", Body=b"not a shard")
    _s3_reads_as_local(f"s3://{bucket}/corpus/", paths)
    local, remote = tmp_path / "local", tmp_path / "s3"
    result = run_cli(*_args(str(tmp_path / "shards"), local))
    assert result.returncode == 0, result.stderr[-3000:]

    killed = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_CHECKPOINT, *_args(f"s3://{bucket}/corpus/", remote)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (remote / "summary.json").exists()
    result = run_cli(*_args(f"s3://{bucket}/corpus/", remote))
    assert result.returncode == 0, result.stderr[-3000:]

    straight, resumed = read_json(local / "summary.json"), read_json(remote / "summary.json")
    assert resumed["resumed_from_step"] == EVERY
    for summary in (straight, resumed):  # set-up, the one train graph of 4 x 64 rows, eval
        assert (summary["compilations"], summary["unexpected_graphs"], summary["padding_fraction"]) == (3, 0, 0.0)
    assert resumed["eval_loss"] == straight["eval_loss"]
    losses = [
        {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r} for run in (local, remote)
    ]
    assert losses[0] == losses[1] and sorted(losses[0]) == list(range(1, STEPS + 1))
    a, b = (load_file(str(run / "model" / "model.safetensors")) for run in (local, remote))
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].view(-1).view(dtype=torch.uint8).equal(b[key].view(-1).view(dtype=torch.uint8)), key
