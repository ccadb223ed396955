"""`run --init-from`: a run started from migrate's NxD shards is the run started from the Hugging Face weights."""

from pathlib import Path

from conftest import RECIPES, read_metrics, run_cli
from safetensors.torch import load_file

SHORT = ["--set", "train.max_steps=3", "--set", "train.schedule.warmup_steps=1", "--set", "train.log_every=1"]
SHORT += ["--set", "checkpoint.every=0"]
RECIPE = str(RECIPES / "tiny-llama-clm.yaml")


def _run(out: Path, *args: str) -> list[float]:
    result = run_cli("run", RECIPE, "--output-dir", str(out), "--no-preflight", *SHORT, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def test_nxd_shards_start_the_run_bit_identical_to_the_hf_weights(tmp_path: Path):
    _run(tmp_path / "pretrain", "--set", "train.eval_at_end=false")
    hf_dir = tmp_path / "pretrain" / "model"
    nxd = tmp_path / "nxd"
    migrated = run_cli("checkpoint", "migrate", str(hf_dir), str(nxd), "--to", "neuron", "--tp", "2")
    assert migrated.returncode == 0, migrated.stderr[-2000:]

    from_hf = _run(tmp_path / "from_hf", "--init-from", str(hf_dir))
    from_nxd = _run(tmp_path / "from_nxd", "--init-from", str(nxd))
    fresh = [r["loss"] for r in read_metrics(tmp_path / "pretrain" / "metrics.jsonl") if "loss" in r]
    assert from_hf == from_nxd and len(from_hf) == 3
    assert from_hf[0] < fresh[0]  # the run really started from the trained weights
    a = load_file(str(tmp_path / "from_hf" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "from_nxd" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_missing_init_from_is_one_line_exit_2(tmp_path: Path):
    path = tmp_path / "nowhere"
    result = run_cli("run", RECIPE, "--output-dir", str(tmp_path / "out"), "--init-from", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"neurontrain: error: --init-from {path} does not exist"
