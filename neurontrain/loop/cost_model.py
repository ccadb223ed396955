"""The bucket / packing planner's cost model per backend: seconds per compiled graph (for the native backend,
per device target and growing with the model's layers), FLOP/s, per-step overhead and saturation."""

from __future__ import annotations

from neurontrain.backends.hosts import native_device_type
from neurontrain.data.buckets import StepCostModel, training_flops_per_token
from neurontrain.loop.model import ModelDims
from neurontrain.recipe import Recipe

# Defaults for the auto-bucket cost model, per backend (the native backend per device target): (seconds per
# compiled graph, FLOP/s, seconds per step, saturation tokens per step). XLA:CPU figures were fitted here to
# tiny-BERT step times at lengths 16..256 (batch 16: ~0.1 s flat up to 64 tokens a sequence, then ~79 us a token);
# Neuron and XLA:CUDA figures are planning estimates (Neuron graphs take minutes to compile) that a recipe can
# override under data.auto_buckets. A native graph's compile time grows with the model's layers: COMPILE_PER_LAYER.
COST_DEFAULTS = {
    "xla-cpu": (5.0, 3.2e10, 0.02, 1024),
    "xla-cuda": (20.0, 5e13, 0.005, 8192),
    "neuron": (300.0, 4e13, 0.01, 4096),
    # inductor on the CPU: tiny BERT (2 layers) compiled its train graph in 23 s on 2 shared, busy cores here
    "native-cpu": (4.0, 3.2e10, 0.02, 1024),
    # inductor on an H100 (torch 2.11): ~7.5-11.5 s a tiny-recipe graph (2 layers), 39.7 s for BERT-base's (12);
    # eager BERT-base trained 13,978 real tokens/s there (about 9e12 FLOP/s at 6 x parameters a token)
    "native-cuda": (3.5, 1e13, 0.01, 8192),
    # TorchNeuron (neuronx-cc behind torch.compile): no trn2 here; planned like Neuron's XLA graphs
    "native-neuron": (300.0, 4e13, 0.01, 4096),
}
COMPILE_PER_LAYER = {"native-cpu": 5.0, "native-cuda": 3.0}  # seconds a graph per transformer layer


def cost_key(backend: str) -> str:
    """The cost model's entry for a backend: the native backend's is its device target's (`native-cuda`...)."""
    if backend != "native":
        return backend
    return f"native-{native_device_type()}"


def compile_seconds_per_graph(backend: str, n_layers: int) -> float:
    """The cost model's default seconds to compile one graph of an n_layers model on a backend."""
    key = cost_key(backend)
    base = COST_DEFAULTS.get(key, COST_DEFAULTS["xla-cpu"])[0]
    return base + COMPILE_PER_LAYER.get(key, 0.0) * n_layers


def cost_model(recipe: Recipe, backend: str, dims: ModelDims) -> StepCostModel:
    spec = recipe.data.auto_buckets
    # eager is the reference run for an XLA run: it must plan the same buckets, so it uses XLA:CPU's figures
    _, flops, overhead, saturation = COST_DEFAULTS.get(cost_key(backend), COST_DEFAULTS["xla-cpu"])
    compile_s = compile_seconds_per_graph(backend, dims.n_layers)
    dense, attention = training_flops_per_token(dims.n_params, dims.n_layers, dims.hidden)
    return StepCostModel(
        compile_seconds=spec.compile_seconds if spec.compile_seconds is not None else compile_s,
        flops_per_second=spec.flops_per_second if spec.flops_per_second is not None else flops,
        step_overhead_seconds=spec.step_overhead_seconds if spec.step_overhead_seconds is not None else overhead,
        flops_per_token=dense,
        attention_flops_per_token_per_position=attention,
        batch_size=recipe.data.batch_size,
        saturation_tokens=spec.saturation_tokens if spec.saturation_tokens is not None else saturation,
    )
