"""`run --init-from`: weights from NxD shards or GPU checkpoints load into the run's model exactly, and AdamW's
moments into the run's optimizer (replicated, or each ZeRO-1 rank's chunks)."""

import logging
from pathlib import Path

import pytest
import torch
from checkpoint_models import bert, llama
from conftest import RECIPES

from neurontrain.backends import select_backend
from neurontrain.checkpoint.initial import InitialCheckpoint, load_initial_weights
from neurontrain.checkpoint.migrate import MigrateOptions, migrate
from neurontrain.errors import UsageError
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.strategies import HostZero1, Replicated
from neurontrain.parallel.zero1_state import chunk, numbered_state
from neurontrain.recipe import load_recipe


def _fresh_like(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return type(model)(model.config)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize(("tp", "fuse", "tied"), [(2, False, False), (4, True, False), (8, False, True)])
def test_nxd_shards_load_bit_identical_to_the_hf_weights(tmp_path, tp, fuse, tied):
    original, hf_dir = llama(tmp_path, tied=tied)
    nxd = tmp_path / "nxd"
    migrate(hf_dir, nxd, MigrateOptions(to="neuron", tp=tp, fuse_qkv=fuse))
    model = _fresh_like(original, seed=1)
    assert not torch.equal(model.model.embed_tokens.weight, original.model.embed_tokens.weight)
    load_initial_weights(model, nxd)
    _assert_same_weights(model, original)
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_hf_and_bf16_shards_load_like_from_pretrained(tmp_path):
    original, hf_dir = bert(tmp_path)
    model = _fresh_like(original, seed=3)
    load_initial_weights(model, hf_dir)
    _assert_same_weights(model, original)

    nxd = tmp_path / "nxd16"
    migrate(hf_dir, nxd, MigrateOptions(to="neuron", tp=2, dtype="bf16"))
    load_initial_weights(model, nxd)
    for name, tensor in original.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor.to(torch.bfloat16).to(tensor.dtype)), name


def test_another_model_is_refused_with_one_line(tmp_path):
    _, hf_dir = llama(tmp_path)
    nxd = tmp_path / "nxd"
    migrate(hf_dir, nxd, MigrateOptions(to="neuron", tp=2))
    other, _ = llama(tmp_path, vocab=256, name="other")
    with pytest.raises(UsageError, match="embed_tokens.weight is \\[128, 64\\] there and \\[256, 64\\]"):
        load_initial_weights(other, nxd)
    bert_model, _ = bert(tmp_path)
    with pytest.raises(UsageError, match="tensors do not fit the recipe's model"):
        load_initial_weights(bert_model, hf_dir)


# -- the optimizer state (`run --init-from` of a checkpoint that holds AdamW's) -----------------------------------


def _trained_with_adamw(tmp_path: Path) -> tuple[torch.nn.Module, dict[str, dict], Path]:
    """Tiny Llama after two eager AdamW steps on a real loss, saved as a torch training checkpoint and migrated
    to NxD shards at tp 2 with its optimizer: (model, its AdamW state by name, the NxD directory)."""
    model, hf_dir = llama(tmp_path)
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "train.pt")
    nxd = tmp_path / "nxd"
    migrate(tmp_path / "train.pt", nxd, MigrateOptions(to="neuron", tp=2, with_optimizer=True, config=hf_dir))
    named = dict(model.named_parameters())
    by_name = {next(n for n, p in named.items() if p is param): state for param, state in optimizer.state.items()}
    return model, by_name, nxd


def _started(nxd: Path, source: torch.nn.Module, dp: DataParallel, weights_only: bool = False):
    """A fresh model of the source's config, and the optimizer strategy a run at dp's place builds for it, both
    started from the checkpoint as `run --init-from` starts them."""
    recipe = load_recipe(RECIPES / "tiny-llama-clm.yaml", ["train.zero1=true"])  # AdamW hyper-parameters only
    model = _fresh_like(source, seed=2)
    start = InitialCheckpoint(nxd, weights_only=weights_only)
    start.load_weights(model)
    backend = select_backend("eager")
    strategy = HostZero1(recipe, model, backend, dp) if dp.enabled else Replicated(recipe, model, backend, dp, False)
    start.load_optimizer(strategy, model)
    return model, strategy


def test_adamw_moments_start_a_replicated_run_as_the_source_left_them(tmp_path):
    source, moments, nxd = _trained_with_adamw(tmp_path)
    model, strategy = _started(nxd, source, DataParallel())
    _assert_same_weights(model, source)
    named = dict(model.named_parameters())
    assert len(strategy.optimizer.state) == len(named) == len(moments)
    for name, param in named.items():
        state = strategy.optimizer.state[param]
        assert float(state["step"]) == 2.0 and state["step"].dtype == torch.float32, name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[moment], moments[name][moment]), (name, moment)
    spec = load_recipe(RECIPES / "tiny-llama-clm.yaml", []).train.optimizer
    for group in strategy.optimizer.param_groups:  # the recipe's hyper-parameters, not the source's lr 1e-2
        assert group["initial_lr"] == spec.lr and tuple(group["betas"]) == tuple(spec.betas)


def test_adamw_moments_reach_each_zero1_rank_as_its_chunks(tmp_path):
    source, moments, nxd = _trained_with_adamw(tmp_path)
    names = [n for n, _ in source.named_parameters()]
    padded = [n for n, p in source.named_parameters() if p.shape[0] % 3]
    for world in (2, 3):  # 3 does not divide every dim 0: padded chunks
        for rank in range(world):
            _, strategy = _started(nxd, source, DataParallel(rank=rank, world=world))
            for name, param in zip(names, strategy.chunks):  # chunks in model order
                state = strategy.optimizer.state[param]
                assert float(state["step"]) == 2.0
                for moment in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(state[moment], chunk(moments[name][moment], world, rank)), (name, rank)
    assert padded  # the world of 3 did pad some parameter


def test_no_optimizer_state_or_weights_only_starts_adamw_fresh(tmp_path, caplog):
    source, _, nxd = _trained_with_adamw(tmp_path)
    _, weights_only = _started(nxd, source, DataParallel(), weights_only=True)
    plain_nxd = tmp_path / "weights-only-nxd"
    migrate(tmp_path / "hf", plain_nxd, MigrateOptions(to="neuron", tp=2))
    with caplog.at_level(logging.INFO, logger="neurontrain"):
        _, without = _started(plain_nxd, source, DataParallel())
    assert not weights_only.optimizer.state and not without.optimizer.state
    assert f"initial optimizer state: {plain_nxd} holds none: AdamW starts fresh" in caplog.text


def test_moments_that_do_not_cover_the_model_are_refused():
    shapes = {"a": (4, 2), "b": (3,)}
    groups = [{"params": [0, 1], "lr": 0.1}]
    full = {
        n: {"exp_avg": torch.ones(s), "exp_avg_sq": torch.ones(s), "step": torch.tensor(3)} for n, s in shapes.items()
    }
    plain = numbered_state(full, ["b", "a"], [shapes["b"], shapes["a"]], groups)
    assert plain["param_groups"] == groups and plain["param_groups"] is not groups
    assert plain["state"][1]["exp_avg"].shape == (4, 2) and plain["state"][0]["step"].dtype == torch.float32
    with pytest.raises(ValueError, match=r"no AdamW moments for 1 of the 3 parameters \(first: c\)"):
        numbered_state(full, ["a", "b", "c"], [(4, 2), (3,), (1,)], groups)
    with pytest.raises(ValueError, match=r"a: exp_avg is \[4, 2\], the parameter \[2, 4\]"):
        numbered_state(full, ["a"], [(2, 4)], groups)
