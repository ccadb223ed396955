"""A run never ends "ok" with a non-finite model: a NaN loss stops it within its step (exit 1) and nothing of that
state is published; a batch with nothing to predict is refused when the run is planned. In this process, on the
eager backend (the XLA:CPU run of the same failure is in tests/integration/test_families.py)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import RECIPES

from neurontrain.backends import select_backend
from neurontrain.errors import UsageError
from neurontrain.loop.finite import LossWatch, NonFiniteError, with_host_weights
from neurontrain.loop.trainer import Trainer
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe

SMALL = ["data.train_samples=160", "data.eval_samples=16", "train.log_every=1", "checkpoint.every=1"]
SMALL += ["train.schedule.warmup_steps=1", "data.max_length=64", "data.packing=off"]


def _plan(recipe: str, steps: int, *overrides: str):
    return make_plan(load_recipe(RECIPES / recipe, [*SMALL, f"train.max_steps={steps}", *overrides]), "eager")


def test_a_nan_loss_stops_the_run_in_its_step_and_publishes_nothing_from_it(tmp_path: Path):
    plan = _plan("tiny-bert-classification.yaml", 8, "train.optimizer.lr=1e6", "train.max_grad_norm=null")
    with pytest.raises(NonFiniteError) as failure:
        Trainer(plan, select_backend("eager"), tmp_path).run()
    message = str(failure.value)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    bad = min(step for step, loss in losses.items() if loss != loss)  # the first NaN step
    assert max(losses) == bad  # no step after it ran
    assert f"at step {bad} on a batch of input_ids 16x" in message and f"at step {bad - 1})" in message
    saved = sorted(int(p.name.removeprefix("step_")) for p in (tmp_path / "checkpoints").iterdir())
    assert saved[-1] == bad - 1  # the newest checkpoint is the last good step's
    assert not (tmp_path / "model").exists() and not (tmp_path / "summary.json").exists()


def test_non_finite_weights_are_never_written_and_the_last_checkpoint_stays_the_newest(tmp_path: Path):
    trainer = Trainer(_plan("tiny-llama-clm.yaml", 2), select_backend("eager"), tmp_path)
    trainer.run()
    with torch.no_grad():
        trainer.model.model.layers[1].mlp.down_proj.weight[3, 5] = float("inf")
    with pytest.raises(NonFiniteError, match=r"weight model\.layers\.1\.mlp\.down_proj\.weight is not finite"):
        trainer.maybe_save(2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    with pytest.raises(NonFiniteError, match="the final model not written"):
        trainer._export(trainer.strategy.export_state(trainer.model))


def test_the_loss_watch_names_the_first_bad_step_and_the_last_good_one():
    watch = LossWatch()
    watch.observe(1, {"input_ids": [8, 64]}, torch.tensor(2.5), torch.tensor(3.5))
    watch.check()
    watch.observe(2, {"input_ids": [8, 32]}, float("inf"))
    watch.observe(3, {"input_ids": [8, 32]}, float("nan"))
    with pytest.raises(NonFiniteError, match=r"inf at step 2 on a batch of input_ids 8x32 \(last finite loss 3 at"):
        watch.check()
    state = {"model": {"w": torch.ones(2)}, "optimizer": {}}
    assert torch.equal(with_host_weights(state, lambda ts: [t.clone() for t in ts], 4)["model"]["w"], torch.ones(2))


def test_a_causal_lm_batch_with_nothing_to_predict_is_refused_when_planned(tmp_path: Path):
    """A tokenizer that makes every text one token (as Qwen2's does of a word-level vocabulary): 0/0 loss."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, "word": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", unk_token="<unk>")
    tokenizer.save_pretrained(str(tmp_path / "tokenizer"))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": "word"}) + "\n" for _ in range(40)))
    source = ["data.source=json", f"data.path={data}", "data.train_samples=null", "data.eval_samples=0"]
    source += ["tokenizer.word_level=null", f"tokenizer.pretrained={tmp_path / 'tokenizer'}"]
    with pytest.raises(UsageError, match="training batch 0 has nothing to predict: its 8 samples are one token"):
        _plan("tiny-llama-clm.yaml", 2, *source)
