"""The bucket / packing planner prices a native graph's compile for the device target it runs on, so `auto`
does not plan more bucket graphs than the run pays back; `run --dry-run` shows the estimate."""

import random

from conftest import RECIPES

from neurontrain.backends.hosts import native_device_type
from neurontrain.data.buckets import (
    COMPILE_PER_LAYER,
    COST_DEFAULTS,
    StepCostModel,
    choose_buckets,
    compile_seconds_per_graph,
    training_flops_per_token,
)
from neurontrain.plan.buckets import cost_key
from neurontrain.plan.description import describe_plan
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe

# BERT-base (110M parameters, 12 layers of 768) at batch 32 and <= 128 tokens, as measured on an H100: 39.7 s for
# its one packed graph; eager trained 150 steps in 12 s there.
BERT_BASE = {"n_params": 109_483_778, "n_layers": 12, "hidden": 768}
MEASURED_BERT_BASE_COMPILE_S = 39.7


def _bert_base_buckets(compile_seconds: float, steps: int = 150, figures: str = "native-cuda"):
    _, flops, overhead, saturation = COST_DEFAULTS[figures]
    dense, attention = training_flops_per_token(**BERT_BASE)
    cost = StepCostModel(compile_seconds, flops, overhead, dense, attention, 32, saturation)
    rng = random.Random(0)
    lengths = [min(128, max(8, int(rng.lognormvariate(3.8, 0.5)))) for _ in range(4000)]
    return choose_buckets(
        lengths, planned_batches=steps, graphs_per_bucket=2, cost=cost, max_buckets=8, multiple=8, max_length=128
    )


def test_cuda_compile_price_is_the_measured_one_within_a_factor_of_two():
    base = COST_DEFAULTS["native-cuda"][0]
    priced = base + COMPILE_PER_LAYER["native-cuda"] * BERT_BASE["n_layers"]
    assert MEASURED_BERT_BASE_COMPILE_S / 2 <= priced <= MEASURED_BERT_BASE_COMPILE_S * 2


def test_a_short_bert_base_run_on_cuda_plans_one_bucket_where_a_flat_price_planned_many():
    flat = _bert_base_buckets(5.0, figures="xla-cpu")  # what the native backend had: XLA:CPU's figures
    priced = _bert_base_buckets(COST_DEFAULTS["native-cuda"][0] + COMPILE_PER_LAYER["native-cuda"] * 12)
    assert len(flat.buckets) >= 3, flat
    assert len(priced.buckets) == 1, priced
    # a long run pays several graphs back
    assert len(_bert_base_buckets(39.5, steps=200_000).buckets) > 1


def test_the_native_price_grows_with_layers_and_eager_xla_keep_theirs():
    device = native_device_type()
    assert device == "cpu"  # this machine: no TorchNeuron, no GPU
    assert cost_key("native") == "native-cpu" and cost_key("eager") == "eager"
    assert compile_seconds_per_graph("native-cpu", 12) > compile_seconds_per_graph("native-cpu", 2)
    assert compile_seconds_per_graph("xla-cpu", 12) == compile_seconds_per_graph("xla-cpu", 2) == 5.0


def test_the_dry_run_shows_the_compile_estimate():
    overrides = ["data.train_samples=200", "data.eval_samples=16", "train.max_steps=8", "data.buckets=[64,128]"]
    overrides.append("train.schedule.warmup_steps=1")
    recipe = load_recipe(RECIPES / "tiny-bert-classification.yaml", overrides)
    native = make_plan(recipe, "native")
    estimate = describe_plan(native)["compile_estimate"]
    per_graph = compile_seconds_per_graph(cost_key("native"), native.dims.n_layers)
    assert estimate["graphs"] == len(native.expected_graphs()) > 0
    assert estimate["seconds"] == round(estimate["graphs"] * per_graph, 1)
