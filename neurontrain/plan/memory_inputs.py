"""The memory planner's inputs for a recipe (shapes from the model built on the meta device, the target from
the recipe and the environment) and the recipe with the planner's choices filled in."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from neurontrain.errors import UsageError
from neurontrain.model.build import meta_model
from neurontrain.model.lora import apply_lora, base_name
from neurontrain.parallel.memory import ModelShape, Param, Workload, resolve_target
from neurontrain.parallel.memory_choice import MemoryPlan, Pins, plan_memory
from neurontrain.recipe import Recipe


def model_shape(recipe: Recipe, config: Any) -> ModelShape:
    """Plain numbers for the planner: every parameter's name and shape (tied weights once), which ones a matmul
    reads (nn.Linear weights and biases, a tied LM head's weight included), and the config's sizes."""
    model = apply_lora(meta_model(recipe, config), recipe)  # LoRA: the base frozen, the adapters trained
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    matmul = {id(p) for module in linears for p in (module.weight, module.bias) if p is not None}
    params = tuple(
        Param(base_name(name), tuple(p.shape), id(p) in matmul, p.requires_grad) for name, p in model.named_parameters()
    )
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    attention_dropout = getattr(config, "attention_dropout", None)
    if attention_dropout is None:
        attention_dropout = getattr(config, "attention_probs_dropout_prob", 0.0)
    return ModelShape(
        family=config.model_type,
        task=recipe.task,
        params=params,
        layers=int(config.num_hidden_layers),
        hidden=hidden,
        heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
        intermediate=int(getattr(config, "intermediate_size", None) or 4 * hidden),
        vocab=int(config.vocab_size),
        labels=int(getattr(config, "num_labels", 2)),
        attention=recipe.model.attn_implementation,
        attention_dropout=float(attention_dropout or 0.0),
        hidden_dropout=float(getattr(config, "hidden_dropout_prob", 0.0) or 0.0),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def _lnc() -> int | None:
    raw = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if raw is None:
        return None
    if raw not in ("1", "2"):
        raise UsageError(f"NEURON_LOGICAL_NC_CONFIG={raw!r}: the Neuron runtime takes 1 or 2")
    return int(raw)


def plan_recipe_memory(recipe: Recipe, config: Any, backend: str, world: int, longest: int) -> MemoryPlan:
    """The memory plan for `world` workers whose longest micro-batch is data.batch_size x `longest` tokens.
    Enforced (nothing fitting refuses the run) on Neuron with a known target (runtime.neuron_target or
    NEURON_PLATFORM_TARGET_OVERRIDE) and wherever runtime.device_memory_gib is given."""
    runtime = recipe.runtime
    neuron_target = runtime.neuron_target
    if neuron_target == "auto" and os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE") in ("trn1", "trn2", "trn3"):
        neuron_target = os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"]
    target, notes = resolve_target(neuron_target, runtime.device_memory_gib, backend, _lnc())
    enforced = runtime.device_memory_gib is not None or (backend == "neuron" and neuron_target != "auto")
    train, tp, pp = recipe.train, recipe.parallel.tp, recipe.parallel.pp
    pins = Pins(
        zero1=None if train.zero1 == "auto" else train.zero1,
        checkpointing=None if train.activation_checkpointing == "auto" else train.activation_checkpointing,
        tp=None if tp == "auto" else tp,
        fsdp=recipe.parallel.fsdp,
        pp=None if pp == "auto" else pp,
    )
    work = Workload(
        batch=recipe.data.batch_size,
        length=longest,
        precision=train.precision,
        world=world,
        grad_accum=train.grad_accum,
        step_samples=train.global_batch_size,
    )
    native = backend == "native"
    if native:  # DTensors by transformers' plan (parallel/native_tp.py)
        tp_available = bool(getattr(meta_model(recipe, config), "tp_plan", None))
    else:
        tp_available = importlib.util.find_spec("neuronx_distributed") is not None
    shape = model_shape(recipe, config)
    plan = plan_memory(shape, work, target, pins, tp_available=tp_available, enforced=enforced, native=native)
    plan.notes += notes
    if not tp_available and pins.tp is None:
        why = "transformers has no tensor-parallel plan for it" if native else "neuronx-distributed is not installed"
        plan.notes.append(f"tensor parallel not tried: {why}")
    if not enforced:
        plan.notes.append(
            f"{backend} is not bound by this memory: the plan picks the configuration {plan.target.name} would "
            "run, and nothing is refused (set runtime.device_memory_gib to enforce it)"
        )
    return plan


def with_memory_choice(recipe: Recipe, plan: MemoryPlan) -> Recipe:
    """The recipe with train.zero1, train.activation_checkpointing, parallel.tp and parallel.pp set to the plan's
    choice."""
    config = plan.choice.config
    train = recipe.train.model_copy(update={"zero1": config.zero1, "activation_checkpointing": config.checkpointing})
    parallel = recipe.parallel.model_copy(update={"tp": config.tp, "pp": config.pp})
    return recipe.model_copy(update={"train": train, "parallel": parallel})
