"""HF / torch / DDP / FSDP / DCP checkpoints <-> NxD per-rank shards: bit-identical round trips, the sharding
rules (GQA replication, fused QKV, pipeline stages), logits, optimizer state, and bad input.

The tests here start processes; the in-process ones are in tests/unit/test_checkpoint_migrate.py."""

import json
import os

import pytest
import torch
from checkpoint_models import llama
from conftest import run_cli

from neurontrain.checkpoint.migrate import MigrateOptions, migrate, open_checkpoint
from neurontrain.checkpoint.verify import compare


def test_cli_migrate_and_verify(tmp_path):
    _, src = llama(tmp_path)
    res = run_cli("checkpoint", "migrate", str(src), str(tmp_path / "nxd"), "--to", "neuron", "--tp", "8", "--fuse-qkv")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["files"] == 8
    same = run_cli("checkpoint", "verify", str(src), str(tmp_path / "nxd"), "--logits", str(src))
    assert same.returncode == 0 and "EQUAL" in same.stdout, same.stdout + same.stderr
    other, other_path = llama(tmp_path, name="other")
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
    other.save_pretrained(other_path)
    diff = run_cli("checkpoint", "verify", str(src), str(other_path), "--json")
    assert diff.returncode == 1
    result = json.loads(diff.stdout)
    assert [r["name"] for r in result["differing"]] == ["model.layers.0.mlp.up_proj.weight"]
    assert result["max_abs_diff"] == pytest.approx(1.0)


def test_older_layout_and_xser_form_are_readable(tmp_path):
    import shutil
    import subprocess
    import sys

    _, src = llama(tmp_path)
    nxd = tmp_path / "nxd"
    migrate(src, nxd, MigrateOptions(to="neuron", tp=2, pp=2))
    old = tmp_path / "old"
    old.mkdir()
    for f in (nxd / "model").iterdir():
        tp, pp = f.name.split("_tp_rank_")[1].split("_pp_rank_")
        (old / f"tp_rank_{tp}_pp_rank_{pp[:2]}").mkdir()
        shutil.copy(f, old / f"tp_rank_{tp}_pp_rank_{pp[:2]}" / "checkpoint.pt")
    xser = tmp_path / "xser"
    (xser / "model").mkdir(parents=True)
    for d in (old, xser):
        shutil.copy(nxd / "checkpoint_spec.json", d)
        shutil.copy(nxd / "config.json", d)
    script = (
        f"import torch, pathlib, torch_xla.utils.serialization as xser\n"
        f"for f in sorted(pathlib.Path({str(nxd / 'model')!r}).iterdir()):\n"
        f"    xser.save(torch.load(f, weights_only=True), {str(xser / 'model')!r} + '/' + f.name)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PJRT_DEVICE": "CPU"},
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert any(p.name.endswith(".tensors") for p in (xser / "model").iterdir())
    reference = open_checkpoint(src)
    for layout in (old, xser):
        back = tmp_path / f"{layout.name}-back"
        migrate(layout, back, MigrateOptions(to="gpu"))
        assert compare(reference, open_checkpoint(back))["equal"], layout.name
