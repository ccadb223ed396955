import pytest
from conftest import RECIPES

from neurontrain.errors import UsageError
from neurontrain.recipe import apply_overrides, load_recipe, parse_override


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem


def test_overrides_parse_yaml_values():
    assert parse_override("data.buckets=[32, 64]") == (["data", "buckets"], [32, 64])
    assert parse_override("train.precision=bf16") == (["train", "precision"], "bf16")
    raw = apply_overrides({"train": {"max_steps": 3}}, ["train.max_steps=7", "runtime.backend=eager"])
    assert raw == {"train": {"max_steps": 7}, "runtime": {"backend": "eager"}}


def test_fingerprint_ignores_step_count_but_not_model():
    base = load_recipe(RECIPES / "tiny-llama-clm.yaml")
    assert base.fingerprint() == load_recipe(RECIPES / "tiny-llama-clm.yaml", ["train.max_steps=99"]).fingerprint()
    assert (
        base.fingerprint()
        != load_recipe(RECIPES / "tiny-llama-clm.yaml", ["model.config.hidden_size=32"]).fingerprint()
    )


def test_bad_override_raises_usage_error():
    with pytest.raises(UsageError):
        load_recipe(RECIPES / "tiny-llama-clm.yaml", ["nonsense"])
