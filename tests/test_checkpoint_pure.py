from pathlib import Path

import torch

from neurontrain.checkpoint import training as ckpt
from neurontrain.loop.model import lr_factor


def test_steps_to_prune_keeps_newest():
    assert ckpt.steps_to_prune([10, 30, 20, 40], 2) == [10, 20]
    assert ckpt.steps_to_prune([10], 3) == []


def test_atomic_save_publish_and_prune(tmp_path: Path):
    for step in (10, 20, 30):
        ckpt.save_checkpoint(tmp_path, step, {"x": torch.tensor([step])}, {"step": step}, keep=2, save_fn=torch.save)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [20, 30]
    state, meta = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))
    assert state["x"].item() == 30 and meta["step"] == 30


def test_partial_writes_are_ignored_and_cleaned(tmp_path: Path):
    ckpt.save_checkpoint(tmp_path, 10, {"x": 1}, {"step": 10}, keep=3, save_fn=torch.save)
    (tmp_path / ".step_00000020.partial").mkdir()
    (tmp_path / ".step_00000020.partial" / "state.pt").write_bytes(b"trunc")
    (tmp_path / "step_00000030").mkdir()  # no marker
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000010"
    removed = ckpt.remove_partial(tmp_path)
    assert sorted(removed) == [".step_00000020.partial", "step_00000030"]


def test_lr_never_exactly_zero_or_jumps():
    for kind in ("linear", "cosine", "constant"):
        factors = [lr_factor(s, 50, kind, 5, 0.0) for s in range(50)]
        assert all(f > 0 for f in factors)
        assert factors[0] < factors[4] <= 1.0
