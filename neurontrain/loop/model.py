"""Model, optimizer and LR schedule from a recipe, shared by `run`, `--dry-run` and (later) `precompile`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from neurontrain.data.collate import IGNORE_INDEX
from neurontrain.errors import UsageError
from neurontrain.recipe import Recipe


@dataclass(frozen=True)
class ModelDims:
    model_type: str
    n_params: int
    n_layers: int
    hidden: int
    is_encoder: bool


def _auto_class(recipe: Recipe):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForCausalLM if recipe.task == "causal-lm" else AutoModelForSequenceClassification


def build_config(recipe: Recipe, tokenizer: Any | None) -> Any:
    from transformers import AutoConfig

    spec = recipe.model
    try:
        if spec.config is not None:
            kwargs = dict(spec.config)
            model_type = kwargs.pop("model_type")
            config = AutoConfig.for_model(model_type, **kwargs)
            if tokenizer is not None and "vocab_size" not in kwargs:
                config.vocab_size = len(tokenizer)
        else:
            config = AutoConfig.from_pretrained(spec.pretrained)
    except UsageError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"cannot build the model config: {first}") from None
    if recipe.task == "sequence-classification":
        config.num_labels = spec.num_labels
    if tokenizer is not None and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    return config


def model_dims(recipe: Recipe, config: Any) -> ModelDims:
    """Sizes for the cost model, from a model built on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = _auto_class(recipe).from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    return ModelDims(
        model_type=config.model_type,
        n_params=n_params,
        n_layers=int(getattr(config, "num_hidden_layers", 1)),
        hidden=int(getattr(config, "hidden_size", 1)),
        is_encoder=not getattr(config, "is_decoder", False) and recipe.task == "sequence-classification",
    )


def build_model(recipe: Recipe, config: Any) -> torch.nn.Module:
    """On CPU, seeded by train.seed so every backend starts from the same weights."""
    spec = recipe.model
    torch.manual_seed(recipe.train.seed)
    cls = _auto_class(recipe)
    try:
        if spec.pretrained is not None:
            model = cls.from_pretrained(spec.pretrained, config=config, attn_implementation=spec.attn_implementation)
        else:
            model = cls.from_config(config, attn_implementation=spec.attn_implementation)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"cannot build model: {first}") from None
    model.train()
    return model


def build_optimizer(recipe: Recipe, model: torch.nn.Module) -> torch.optim.Optimizer:
    spec = recipe.train.optimizer
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=spec.lr, betas=spec.betas, eps=spec.eps)


def lr_factor(step: int, max_steps: int, kind: str, warmup: int, min_ratio: float) -> float:
    """LR multiplier for 0-based `step`. Never exactly 0: on XLA the scalars 0 and 1 are baked into the graph
    as constants, so an LR of 0 at one step would compile a graph of its own."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, max_steps - warmup)
    if kind == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(recipe: Recipe, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    s, total = recipe.train.schedule, recipe.train.max_steps
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total, s.kind, s.warmup_steps, s.min_lr_ratio)
    )


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW state and gradient buffers before step 1, as AdamW itself would on its first step.

    AdamW creates its state lazily; on XLA that makes the first step a graph of its own. Creating it here
    (then one sync) lets the first step share its bucket's graph with every later step.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def model_inputs(batch: dict, dims: ModelDims, dtype: torch.dtype) -> dict:
    """For encoders, a ready 4D additive attention mask: transformers 5 otherwise inspects the 2D mask's
    values (`mask.all()`) on every forward, which is a host sync and one more graph per shape on XLA."""
    inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    mask = batch["attention_mask"]
    if dims.is_encoder:
        inputs["attention_mask"] = (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
    else:
        inputs["attention_mask"] = mask
    return inputs


def eval_statistics(outputs: Any, labels: torch.Tensor, task: str) -> torch.Tensor:
    """[loss * counted, counted, correct] for one batch, computed on the device."""
    if task == "causal-lm":
        counted = (labels[:, 1:] != IGNORE_INDEX).sum()
        correct = torch.zeros((), device=labels.device)
    else:
        valid = labels != IGNORE_INDEX
        counted = valid.sum()
        correct = ((outputs.logits.argmax(-1) == labels) & valid).sum()
    counted = counted.to(torch.float32)
    return torch.stack([outputs.loss.float() * counted, counted, correct.to(torch.float32)])
