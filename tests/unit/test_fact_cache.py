"""The fact cache (neurontrain/fact_cache.py) behind checkpoint matching and the TP plans: a migration of a model
whose facts are stored imports no modeling module and builds no model, and holds its output against the stored
state dict exactly as `load_state_dict(strict=True)` of the real model would."""

import json

import pytest
import torch
from families import tiny_config
from safetensors.torch import save_file

from neurontrain import fact_cache
from neurontrain.checkpoint import matching
from neurontrain.checkpoint.migrate import MigrateOptions, migrate
from neurontrain.errors import NeurontrainError
from neurontrain.parallel import plans


@pytest.fixture
def fresh_facts(tmp_path, monkeypatch):
    monkeypatch.setenv("NEURONTRAIN_FACT_CACHE", str(tmp_path / "facts"))
    for cached in (matching._facts, matching._conversions, plans.tp_plan, plans._resolved):
        cached.cache_clear()
    yield tmp_path / "facts"
    for cached in (matching._facts, matching._conversions, plans.tp_plan, plans._resolved):
        cached.cache_clear()


def _hf_checkpoint(directory, model_type: str, **overrides) -> dict:
    import transformers

    config = tiny_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config)
    directory.mkdir()
    tensors = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight" or not config.tie_word_embeddings
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(config.to_json_string())
    return json.loads(config.to_json_string())


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_a_second_migration_builds_no_model_unless_converters_apply(tmp_path, fresh_facts, monkeypatch, model_type):
    _hf_checkpoint(tmp_path / "hf", model_type)
    first = migrate(tmp_path / "hf", tmp_path / "nxd-1", MigrateOptions(to="neuron", tp=2))
    assert sorted(p.name.split("-")[0] for p in fresh_facts.iterdir()) == ["loaded", "model", "tp"]
    for cached in (matching._facts, matching._conversions, plans.tp_plan, plans._resolved):
        cached.cache_clear()  # as a new process starts

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built although its facts are stored")

    monkeypatch.setattr(matching, "model_from_config", no_model)
    monkeypatch.setattr(plans, "_tp_plan_of", no_model)
    if model_type == "mixtral":  # its converters merge the experts: the model is built every time
        with pytest.raises(AssertionError, match="facts are stored"):
            migrate(tmp_path / "hf", tmp_path / "nxd-2", MigrateOptions(to="neuron", tp=2))
        return
    second = migrate(tmp_path / "hf", tmp_path / "nxd-2", MigrateOptions(to="neuron", tp=2))
    assert {k: v for k, v in second.items() if k not in ("shards", "destination")} == {
        k: v for k, v in first.items() if k not in ("shards", "destination")
    }
    one, two = sorted((tmp_path / "nxd-1").rglob("*.pt")), sorted((tmp_path / "nxd-2").rglob("*.pt"))
    assert [p.name for p in one] == [p.name for p in two] and one
    for a, b in zip(one, two):
        sa, sb = torch.load(a), torch.load(b)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("tied", [True, False])
def test_the_stored_check_refuses_what_a_strict_load_refuses(fresh_facts, tied):
    import transformers

    config = tiny_config("llama", tie_word_embeddings=tied)
    config_dict = json.loads(config.to_json_string())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    good = {n: tuple(t.shape) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
    cases = {
        "as saved": good,
        "missing": {n: s for n, s in good.items() if not n.endswith("layers.1.mlp.up_proj.weight")},
        "unexpected": {**good, "model.layers.9.mlp.up_proj.weight": (8, 8)},
        "wrong shape": {**good, "model.norm.weight": (65,)},
        "tied under its other name": (
            {
                **{n: s for n, s in good.items() if n != "model.embed_tokens.weight"},
                "lm_head.weight": good["model.embed_tokens.weight"],
            }
            if tied
            else good
        ),  # fmt: skip
    }
    for case, shapes in cases.items():
        state = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
        if tied:
            present = "model.embed_tokens.weight" if "model.embed_tokens.weight" in state else "lm_head.weight"
            state.setdefault("lm_head.weight", state.get(present))
            state.setdefault("model.embed_tokens.weight", state[present])
        try:
            model.load_state_dict(state, strict=True, assign=True)
            refused = False
        except RuntimeError:
            refused = True
        for attempt in ("derived", "stored"):
            matching._facts.cache_clear()
            if refused:
                with pytest.raises(NeurontrainError, match="strict=True"):
                    matching.check_loads(config_dict, shapes, f"{case} ({attempt})")
            else:
                matching.check_loads(config_dict, shapes, f"{case} ({attempt})")


def test_a_fact_is_keyed_by_the_versions_and_an_unreadable_one_is_derived_again(fresh_facts, monkeypatch):
    config = json.loads(tiny_config("llama").to_json_string())
    names = matching.model_names(config)
    (stored,) = fresh_facts.glob("model-names-*.json")
    stored.write_text("{not json")
    matching._facts.cache_clear()
    assert matching.model_names(config) == names  # derived again, and written again
    assert json.loads(stored.read_text())["kind"] == "model-names"
    real = fact_cache.metadata.version
    monkeypatch.setattr(fact_cache.metadata, "version", lambda name: "9.9" if name == "transformers" else real(name))
    assert fact_cache.read_fact("model-names", config) is None  # another transformers: another key
