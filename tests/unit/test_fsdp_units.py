"""FSDP2 on the native backend without a process group: which layers are its units, how many graphs the plan
expects, the recipe knob, the guard's count per key, and the checkpoint's shard writer."""

from pathlib import Path

import pytest
import torch
from conftest import RECIPES

from neurontrain.errors import UsageError
from neurontrain.loop import checkpoints as ckpt
from neurontrain.loop.guard import RecompilationGuard
from neurontrain.model.build import build_config, meta_model
from neurontrain.parallel.fsdp_units import planned_graph_count, transformer_layers
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe

SMALL = ["data.train_samples=200", "data.eval_samples=16", "train.max_steps=8", "train.schedule.warmup_steps=1"]


@pytest.mark.parametrize(
    ("recipe", "layer_class"),
    [("tiny-llama-clm", "LlamaDecoderLayer"), ("tiny-bert-classification", "BertLayer")],
)
def test_the_units_are_the_models_transformer_layers(recipe: str, layer_class: str):
    loaded = load_recipe(RECIPES / f"{recipe}.yaml", ["model.config.num_hidden_layers=3"])
    model = meta_model(loaded, build_config(loaded, None))
    layers = transformer_layers(model)
    assert [type(layer).__name__ for layer in layers] == [layer_class] * 3


def test_a_model_without_repeated_layers_is_refused_in_one_line():
    mixed = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU()]), torch.nn.Linear(2, 2))
    with pytest.raises(UsageError, match="Sequential has no list of repeated layers"):
        transformer_layers(mixed)


def test_planned_graphs_are_one_per_key_or_one_per_key_and_layer():
    assert planned_graph_count(3, 4, fsdp=False) == 3
    assert planned_graph_count(3, 4, fsdp=True) == 12


def test_fsdp_is_native_only_shards_several_workers_and_keeps_the_fingerprint():
    plain = load_recipe(RECIPES / "tiny-llama-clm.yaml", SMALL)
    fsdp = load_recipe(RECIPES / "tiny-llama-clm.yaml", [*SMALL, "parallel.fsdp=true"])
    assert fsdp.fingerprint() == plain.fingerprint()  # the same computation, laid out differently
    assert make_plan(fsdp, "native", world=2).fsdp and not make_plan(plain, "native", world=2).fsdp
    assert not make_plan(fsdp, "native", world=1).fsdp  # one worker: nothing to shard
    for backend in ("xla-cpu", "eager"):
        with pytest.raises(UsageError, match="parallel.fsdp: FSDP2 runs on the native backend"):
            make_plan(fsdp, backend, world=2)


def test_the_guard_takes_one_graph_per_layer_for_a_planned_key():
    compiles = [0]
    guard = RecompilationGuard([("train", 8)], "warn", lambda: compiles[0], lambda: 0, graphs_per_key=2)
    compiles[0] = 2
    guard.after_sync(("train", 8), 1)
    assert guard.unexpected == [] and guard.distinct_graphs == 2
    compiles[0] = 5
    guard.after_sync(("eval", 8), 2)
    assert [e["reason"] for e in guard.unexpected] == ["not in the plan"]
    fresh = RecompilationGuard([("train", 8)], "warn", lambda: compiles[0], lambda: 0, graphs_per_key=2)
    compiles[0] = 8
    fresh.after_sync(("train", 8), 1)
    assert [e["reason"] for e in fresh.unexpected] == ["more graphs than syncs"]


def test_the_shard_writer_writes_into_the_checkpoint_before_it_is_published(tmp_path: Path):
    seen: list[Path] = []

    def write(directory: Path) -> None:
        assert directory.name.endswith(".partial") and not (directory / ckpt.MARKER).exists()
        seen.append(directory)
        (directory / "dcp").mkdir()
        (directory / "dcp" / ".metadata").write_bytes(b"x")

    final = ckpt.save_checkpoint(tmp_path, 4, {"data_position": 4}, {"step": 4}, 3, torch.save, shard_writer=write)
    assert len(seen) == 1 and (final / "dcp" / ".metadata").is_file() and (final / ckpt.MARKER).is_file()
