"""The Trainer and the RunPlan in this process, on the eager backend (no torch-xla state to leak between
tests): the summary `run` returns, the checkpoint state and resuming from it, the plan's own checks."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import RECIPES
from safetensors.torch import load_file

from neurontrain.backends import select_backend
from neurontrain.errors import UsageError
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.rng import graph_seed
from neurontrain.loop.summary import RunSummary, read_summary
from neurontrain.loop.trainer import Trainer
from neurontrain.plan.planning import RunPlan, make_plan
from neurontrain.recipe import load_recipe

SMALL = [
    "data.train_samples=200",
    "data.eval_samples=16",
    "train.log_every=1",
    "checkpoint.every=2",
    "train.schedule.warmup_steps=1",
]


def _plan(steps: int, *overrides: str) -> RunPlan:
    recipe = load_recipe(RECIPES / "tiny-llama-clm.yaml", [*SMALL, f"train.max_steps={steps}", *overrides])
    return make_plan(recipe, "eager")


def _losses(out: Path) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_run_returns_the_summary_it_writes_and_the_state_holds_the_run(tmp_path: Path):
    trainer = Trainer(_plan(3), select_backend("eager"), tmp_path)
    summary = trainer.run()
    assert isinstance(summary, RunSummary) and read_summary(tmp_path) == summary
    assert (summary.steps, summary.resumed_from_step, summary.unexpected_graphs) == (3, None, 0)
    assert summary.first_loss == _losses(tmp_path)[1] and summary.final_loss == _losses(tmp_path)[3]
    assert summary.eval_loss is not None and summary.eval_accuracy is None  # causal LM: no accuracy
    state = trainer.state_dict()
    assert sorted(state) == ["data_position", "model", "optimizer", "scheduler"]  # no RNG: steps seed themselves
    assert state["data_position"] == 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]


class _Killed(Exception):
    pass


@pytest.mark.parametrize("packing", ["off", "on"])
def test_resuming_from_a_checkpoint_continues_bit_identically(tmp_path: Path, packing: str):
    backend = select_backend("eager")
    Trainer(_plan(4, f"data.packing={packing}"), backend, tmp_path / "straight").run()
    killed = Trainer(_plan(4, f"data.packing={packing}"), backend, tmp_path / "resumed")
    save = killed.maybe_save

    def save_then_die(step: int) -> None:
        save(step)
        if step == 3:
            raise _Killed  # after step 3: its checkpoint is not due (every 2), so the resumed run repeats it

    killed.maybe_save = save_then_die
    with pytest.raises(_Killed):
        killed.run()
    assert max(_losses(tmp_path / "resumed")) == 3
    summary = Trainer(_plan(4, f"data.packing={packing}"), backend, tmp_path / "resumed").run()
    assert summary.resumed_from_step == 2
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")
    a, b = (load_file(str(tmp_path / run / "model" / "model.safetensors")) for run in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_of_another_recipe_is_refused(tmp_path: Path):
    backend = select_backend("eager")
    Trainer(_plan(2), backend, tmp_path).run()
    with pytest.raises(UsageError, match="written by a different recipe"):
        Trainer(_plan(4, "train.optimizer.lr=0.5"), backend, tmp_path).run()


def test_trainer_arguments_are_checked():
    plan, backend = _plan(2), select_backend("eager")
    with pytest.raises(ValueError, match="needs a graph_identifier"):
        Trainer(plan, backend, Path("unused"), manifest_graphs={"g"})
    with pytest.raises(ValueError, match="plan for 1 workers run by a group of 2"):
        Trainer(plan, backend, Path("unused"), dp=DataParallel(rank=0, world=2))
    with pytest.raises(TypeError):
        Trainer(plan, backend, Path("unused"), {"g"})  # keyword-only after output_dir


def test_run_plan_is_keyword_only_and_checks_its_bounds():
    plan = _plan(2, "data.packing=off")
    n = plan.data.train_samples  # documents longer than data.max_length are split into several samples
    with pytest.raises(TypeError):
        RunPlan(plan.recipe, plan.backend)  # keyword-only
    cases = [
        ({"world": 0}, "0 workers; a run needs at least one"),
        ({"world": n + 1}, f"{n + 1} workers but only {n} training samples"),
        ({"bucket_mode": "magic"}, "bucket mode 'magic' is not one of"),
        ({"buckets": [128, 64]}, "must be positive and strictly increasing"),
        ({"buckets": None}, "bucket mode auto with buckets None"),
        ({"train_lengths_used": []}, "no training batch"),
        ({"host_reduce": True}, "a host all-reduce needs more than one worker"),
        ({"backend": "tpu"}, "unknown backend 'tpu'"),
        ({"world": 2}, "batches of 8 rows are not data.batch_size 8 x 2 workers"),
    ]
    for changes, message in cases:
        with pytest.raises(UsageError, match=message) as caught:
            dataclasses.replace(plan, **changes)
        assert "\n" not in str(caught.value)


def test_each_graph_seed_depends_on_the_seed_step_micro_batch_and_rank_only():
    keys = [(seed, step, micro, rank) for seed in (0, 1) for step in (1, 2) for micro in (0, 1) for rank in (0, 1)]
    seeds = [graph_seed(*key) for key in keys]
    assert len(set(seeds)) == len(keys) and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [graph_seed(*key) for key in keys]
