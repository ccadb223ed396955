"""The model from a recipe: its config (checked value by value), its sizes, its weights, its inputs."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint

from neurontrain.backends import is_xla_backend, resolve_backend_name
from neurontrain.data.collate import IGNORE_INDEX
from neurontrain.errors import UsageError, first_line
from neurontrain.model.hub_kernels import hub_kernels
from neurontrain.model.input_probe import probe_model_inputs
from neurontrain.model.inputs import MASK_4D, ModelInputs
from neurontrain.model.lora import apply_lora, load_weights, save_model  # noqa: F401 - load_weights: the trainer's
from neurontrain.model.packed import packed_inputs
from neurontrain.parallel.checkpointing import checkpoint_interval
from neurontrain.parallel.tensor_parallel import to_tensor_parallel
from neurontrain.recipe import Recipe


@dataclass(frozen=True)
class ModelDims:
    model_type: str
    n_params: int
    n_layers: int
    hidden: int
    is_encoder: bool
    inputs: ModelInputs = field(default_factory=ModelInputs)  # how the loop calls it (model/inputs.py)


def _auto_class(recipe: Recipe) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification  # lazy: a second to import

    return AutoModelForCausalLM if recipe.task == "causal-lm" else AutoModelForSequenceClassification


def _blame(keys: list[str], works_without: Callable[[set[str]], bool]) -> list[str]:
    """The first key (else pair of keys) of `keys` whose values, left out, make the failing construction work:
    a size that does not divide another is the two values together."""
    for key in keys:
        if works_without({key}):
            return [key]
    return next((list(pair) for pair in itertools.combinations(keys, 2) if works_without(set(pair))), [])


def _where(keys: list[str], values: dict[str, Any]) -> str:
    """`model.config.KEY: VALUE` for the keys to blame (`model.config:` when no key or pair of keys is)."""
    named = " with ".join(f"model.config.{key}: {values[key]!r}" for key in keys)
    return named or "model.config:"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KeyError):  # an unknown name (an activation function, a rope type): the message is the name
        return f"unknown {first_line(exc)}"
    return first_line(exc.__cause__ or exc)


def _succeeds(build: Callable[[], Any]) -> bool:
    try:
        build()
    except Exception:
        return False
    return True


def _config_from_values(model_type: str, values: dict[str, Any]) -> Any:
    from transformers import AutoConfig  # lazy: a second to import

    return AutoConfig.for_model(model_type, **values)


def _check_counts(model_type: str, values: dict[str, Any]) -> None:
    """A negative count (layers, heads, sizes) builds an empty or broken model without an error: refuse it
    where transformers' own default for the key is a positive integer."""
    defaults = _config_from_values(model_type, {})
    for key, value in values.items():
        default = getattr(defaults, key, None)
        positive_default = isinstance(default, int) and not isinstance(default, bool) and default > 0
        if positive_default and isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise UsageError(f"model.config.{key}: {value} must not be negative ({model_type}'s default is {default})")


def _config_from_recipe(recipe: Recipe) -> Any:
    """transformers' config class with the recipe's model.config values; a value it refuses is named."""
    from transformers import CONFIG_MAPPING  # lazy: a second to import

    values = dict(recipe.model.config)
    model_type = values.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UsageError(f"model.config.model_type: {model_type!r} is not a model type transformers knows")
    try:
        config = _config_from_values(model_type, values)
    except Exception as exc:

        def works_without(keys: set[str]) -> bool:
            return _succeeds(
                lambda: _config_from_values(model_type, {k: v for k, v in values.items() if k not in keys})
            )

        where = _where(_blame(list(values), works_without), values)
        raise UsageError(f"{where} is not a valid {model_type} config ({_reason(exc)})") from None
    _check_counts(model_type, values)
    return config


def build_config(recipe: Recipe, tokenizer: Any | None) -> Any:
    """The model's config: the recipe's model.config values through transformers' config class, or the
    pretrained model's own config; sized to the tokenizer and the recipe's labels."""
    from transformers import AutoConfig  # lazy: a second to import

    spec = recipe.model
    if spec.config is not None:
        config = _config_from_recipe(recipe)
        given = spec.config.get("vocab_size")
        if tokenizer is not None and "vocab_size" not in spec.config:
            config.vocab_size = len(tokenizer)
        elif tokenizer is not None and isinstance(given, int) and given < len(tokenizer):
            raise UsageError(f"model.config.vocab_size: {given} is less than the tokenizer's {len(tokenizer)} tokens")
    else:
        try:
            config = AutoConfig.from_pretrained(spec.pretrained)
        except Exception as exc:
            raise UsageError(f"cannot build the model config: {first_line(exc)}") from None
    if recipe.task == "sequence-classification":
        config.num_labels = spec.num_labels
    if tokenizer is not None and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    if tokenizer is not None:
        _special_ids_in_vocab(config, tokenizer, spec.config or {})
    return config


SPECIAL_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id")


def _outside(value: Any, vocab: int) -> bool:
    values = value if isinstance(value, list) else [value]
    return any(isinstance(v, int) and not 0 <= v < vocab for v in values)


def _special_ids_in_vocab(config: Any, tokenizer: Any, given: dict) -> None:
    """A special token id of the config's class defaults outside the vocabulary (Phi-3's pad id 32000 with a
    small tokenizer) becomes the tokenizer's (None where the tokenizer has none); one the recipe set is
    refused."""
    vocab = int(config.vocab_size)
    for name in SPECIAL_IDS:
        value = getattr(config, name, None)
        if not _outside(value, vocab):
            continue
        if name in given:
            raise UsageError(f"model.config.{name}: {value} is outside the vocabulary of {vocab} tokens")
        replacement = getattr(tokenizer, name, None)
        setattr(config, name, replacement if not _outside(replacement, vocab) else None)


def _meta_model(recipe: Recipe, config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return _auto_class(recipe).from_config(config)


def meta_model(recipe: Recipe, config: Any) -> torch.nn.Module:
    """The model built on the meta device (shapes only: no memory, no weights). A config value that cannot
    build it (a negative size, heads that do not divide the hidden size, an unknown activation) is a
    UsageError naming its model.config key."""
    try:
        return _meta_model(recipe, config)
    except Exception as exc:
        values = {k: v for k, v in (recipe.model.config or {}).items() if k != "model_type"}
        defaults = type(config)()

        def works_without(keys: set[str]) -> bool:
            trial = copy.deepcopy(config)
            for key in keys:
                setattr(trial, key, getattr(defaults, key, None))
            return _succeeds(lambda: _meta_model(recipe, trial))

        where = _where(_blame(list(values), works_without), values)
        if recipe.model.pretrained is not None:
            where = f"model.pretrained {recipe.model.pretrained!r}:"
        raise UsageError(f"{where} cannot build the {config.model_type} model ({_reason(exc)})") from None


def model_dims(recipe: Recipe, config: Any) -> ModelDims:
    """Sizes for the cost model, from the model built on the meta device (no memory, no weights); how the loop
    calls the model, from a two-layer copy of it on eager CPU (`model/input_probe.py`)."""
    model = meta_model(recipe, config)
    n_params = sum(p.numel() for p in model.parameters())
    apply_lora(model, recipe)  # a target the model lacks is refused here, before anything compiles
    return ModelDims(
        model_type=config.model_type,
        n_params=n_params,
        n_layers=int(getattr(config, "num_hidden_layers", 1)),
        hidden=int(getattr(config, "hidden_size", 1)),
        is_encoder=not getattr(config, "is_decoder", False) and recipe.task == "sequence-classification",
        inputs=probe_model_inputs(config, recipe.task, recipe.model.attn_implementation),
    )


def build_model(recipe: Recipe, config: Any) -> torch.nn.Module:
    """On CPU, seeded by train.seed so every backend starts from the same weights; under parallel.tp > 1 its
    layers then replaced by NxD's parallel layers holding this rank's shards of those weights (NxD's model
    parallel state initialised before); its layers checkpointed as train.activation_checkpointing says (so
    `run` and `precompile` trace the same graphs)."""
    spec = recipe.model
    torch.manual_seed(recipe.train.seed)
    cls = _auto_class(recipe)
    kernels = hub_kernels(recipe)
    try:
        if spec.pretrained is not None:
            model = cls.from_pretrained(
                spec.pretrained, config=config, attn_implementation=spec.attn_implementation, use_kernels=kernels
            )
        else:
            model = cls.from_config(config, attn_implementation=spec.attn_implementation)
            if kernels:
                model.set_use_kernels(True)
    except Exception as exc:
        raise UsageError(f"cannot build model: {first_line(exc)}") from None
    static_experts(model, recipe.runtime.backend)
    model = apply_lora(model, recipe)
    tp = recipe.parallel.tp
    if tp != "auto" and tp > 1 and resolve_backend_name(recipe.runtime.backend) != "native":
        to_tensor_parallel(model, tp)  # native: the strategy shards it by transformers' plan (DTensors)
    model.train()
    settle_problem_type(model, recipe.task)
    enable_activation_checkpointing(model, recipe.train.activation_checkpointing, recipe.runtime.backend)
    return model


def static_experts(model: torch.nn.Module, backend: str) -> None:
    """On XLA a mixture of experts runs transformers' `batched_mm` experts (each token's experts gathered: static
    shapes); its default `grouped_mm` counts tokens per expert with an integer histogram XLA:CPU lacks and
    multiplies groups of data-dependent sizes."""
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if is_xla_backend(resolve_backend_name(backend)) and can_set is not None and can_set():
        model.set_experts_implementation("batched_mm")


def settle_problem_type(model: torch.nn.Module, task: str) -> None:
    """Set a sequence classifier's `config.problem_type` to what transformers' forward would set on its first
    call (one label: regression; more: single-label classification, the collator's labels being class ids).
    Written inside forward, it is state torch.compile guards on: the second step would recompile. The value
    is the same, so the other backends' graphs, checkpoints and export do not change."""
    config = getattr(model, "config", None)
    if task == "sequence-classification" and config is not None and config.problem_type is None:
        config.problem_type = "regression" if config.num_labels == 1 else "single_label_classification"


def _checkpoint_function(backend: str) -> Callable:
    """torch-xla's checkpoint on the XLA backends (it puts an optimization barrier before the recompute, so
    XLA cannot merge the recompute back into the forward pass; torch's own fails on XLA, and torch-xla's
    supports only the reentrant form); torch's non-reentrant checkpoint on eager and native."""
    if not is_xla_backend(resolve_backend_name(backend)):
        return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    from torch_xla.utils.checkpoint import checkpoint  # lazy: importing torch_xla starts a runtime

    return functools.partial(checkpoint, use_reentrant=True)


def enable_activation_checkpointing(model: torch.nn.Module, setting: str, backend: str) -> None:
    """Recompute the activations of every N-th transformer layer in the backward pass, through Hugging Face's
    own hook (`_set_gradient_checkpointing`: the layers' GradientCheckpointingLayer flag and the function it
    calls; its public `activation_checkpointing_enable` only takes torch's checkpoint). The RNG state is saved
    and restored around the recompute, so dropout draws the same masks and losses equal a run without it."""
    interval = checkpoint_interval(setting)
    if interval is None:
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UsageError(
            f"train.activation_checkpointing: {setting}: {type(model).__name__} does not support activation "
            "checkpointing (set it to none)"
        )
    model._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=_checkpoint_function(backend), every_n_layers=interval
    )


def model_inputs(batch: dict, dims: ModelDims, dtype: torch.dtype) -> dict:
    """The model's keyword arguments as `dims.inputs` decided: a ready 4D additive attention mask where the model
    honours one (transformers 5 otherwise inspects a 2D mask's values, `mask.all()`, on every forward: a host
    sync and one more graph per shape on XLA), else the 2D mask; use_cache=False where the forward takes it.
    Packed batches get their per-document mask and positions (`model/packed.py`)."""
    decided = dims.inputs
    if "document_ids" in batch:
        return packed_inputs(batch, not dims.is_encoder, dtype, decided.use_cache, decided.position_offset)
    inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    mask = batch["attention_mask"]
    if decided.mask == MASK_4D:
        inputs["attention_mask"] = (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
    else:
        inputs["attention_mask"] = mask
    if decided.use_cache:
        inputs["use_cache"] = False
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


# The packages DeepSpeed's accelerator detection imports (besides torch's own CUDA, XPU and MPS)
_DEEPSPEED_ACCELERATOR_PACKAGES = (
    "torch_npu",
    "torch_sdaa",
    "habana_frameworks",
    "torch_mlu",
    "torch_supa",
    "torch_xmlir",
)


def _deepspeed_would_pick_the_cpu() -> bool:
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        return False
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return False
    return not any(importlib.util.find_spec(name) for name in _DEEPSPEED_ACCELERATOR_PACKAGES)


@contextlib.contextmanager
def _deepspeed_accelerator_named() -> Iterator[None]:
    """transformers' save_pretrained loads DeepSpeed where it is installed (unwrap_model -> accelerate's
    extract_model_from_parallel -> `from deepspeed import DeepSpeedEngine`), and loading it picks DeepSpeed's
    accelerator: finding none, it warns "Setting accelerator to CPU ..." on stdout, among the JSON `run` prints.
    Where DeepSpeed would pick the CPU anyway, its own DS_ACCELERATOR variable names it, silently; only while
    nothing named one and DeepSpeed is not loaded yet, and only for the call."""
    name = "" if "DS_ACCELERATOR" in os.environ or "deepspeed" in sys.modules else "cpu"
    if name and _deepspeed_would_pick_the_cpu():
        os.environ["DS_ACCELERATOR"] = name
        try:
            yield
        finally:
            os.environ.pop("DS_ACCELERATOR", None)
    else:
        yield


def move_to_device(model: torch.nn.Module, device: Any) -> torch.nn.Module:
    """`model.to(device)` with shared parameters still shared. Moving to an XLA device makes a new parameter for
    each module that holds one, so an LM head tied to the embedding (GPT-2, Gemma, Llama 3.2 1B) would train as a
    second matrix and the export would no longer be the tied model its config says."""
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    model.to(device)
    for places in holders.values():
        (first, first_name), *others = places
        for module, name in others:
            setattr(module, name, getattr(first, first_name))
    return model


def host_copies(weights: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Host copies of the model's weights (its state dict's names), one per parameter: names of one shared
    parameter (an LM head tied to the embedding) share one copy, so save_pretrained writes it once whatever the
    backend (on XLA every state-dict entry is a tensor of its own)."""
    canonical: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical[name] = first.setdefault(id(param), name)
    copies: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        key = canonical.get(name, name)
        if key not in copies:
            copies[key] = tensor.detach().cpu()
    return {name: copies[canonical.get(name, name)] for name in weights}


def save_pretrained(model: torch.nn.Module, target: Path, state_dict: dict[str, torch.Tensor], recipe: Recipe) -> None:
    """`model.save_pretrained` without DeepSpeed's accelerator warning (`_deepspeed_accelerator_named`); a LoRA
    model's adapter folder (and with model.lora.save_merged the merged model beside it, `model/lora.py`)."""
    with _deepspeed_accelerator_named():
        save_model(model, target, state_dict, recipe)
