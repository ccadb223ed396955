"""LoRA adapters through peft (`model.lora`): the base model frozen, peft's LoRA layers (and `modules_to_save`)
trained. The run's `model/` is peft's adapter folder (`adapter_config.json`, `adapter_model.safetensors` under peft's
key names), which `PeftModel.from_pretrained(base, run/model)` loads; `model.lora.save_merged` also writes the base
with the adapters merged in (peft's `merge_and_unload`) to `model-merged/` in the family's save_pretrained layout.
Training checkpoints hold the trainable tensors only; the frozen base is rebuilt from the recipe on resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from neurontrain.errors import UsageError, first_line
from neurontrain.recipe import Recipe
from neurontrain.recipe_sft import LoraSpec

MERGED_DIR = "model-merged"
_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS"}


def lora_config(spec: LoraSpec, task: str, base: str | None) -> Any:
    from peft import LoraConfig  # lazy: peft imports transformers

    return LoraConfig(
        task_type=_TASK_TYPES[task],
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        modules_to_save=list(spec.modules_to_save) or None,
        use_rslora=spec.use_rslora,
        base_model_name_or_path=base,
    )


def _module_names(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}


def _check_names(model: torch.nn.Module, spec: LoraSpec) -> None:
    """A named target or module to save the model does not have, refused with the names it has."""
    have = _module_names(model)
    for key, names in (("target_modules", spec.target_modules), ("modules_to_save", spec.modules_to_save)):
        if not isinstance(names, list):
            continue
        missing = [n for n in names if n not in have and not any(m.endswith(n) for m, _ in model.named_modules())]
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise UsageError(
                f"model.lora.{key}: {type(model).__name__} has no module {', '.join(map(repr, missing))} "
                f"(its linear layers: {', '.join(linear)})"
            )


def apply_lora(model: torch.nn.Module, recipe: Recipe) -> torch.nn.Module:
    """`model` wrapped by peft with the recipe's adapters (every other parameter frozen); unchanged without
    model.lora. Works on a model on the meta device (planning checks the targets and counts what trains)."""
    spec = recipe.model.lora
    if spec is None:
        return model
    _check_names(model, spec)
    from peft import get_peft_model  # lazy: peft imports transformers

    try:
        return get_peft_model(model, lora_config(spec, recipe.task, recipe.model.pretrained))
    except (ValueError, TypeError, KeyError) as exc:  # peft's refusals of a config it cannot apply
        raise UsageError(f"model.lora: {first_line(exc)}") from None


def base_name(name: str) -> str:
    """A parameter's name in the base model (peft's wrapper prefix and `base_layer` dropped; an adapter's name
    keeps its lora_A / lora_B part)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def checkpoint_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a training checkpoint holds: all of them, or with LoRA the trained ones only (the adapters and
    modules_to_save; the frozen base comes back from the recipe)."""
    if not is_lora(model):
        return model.state_dict()
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: t for name, t in model.state_dict().items() if name in trained}


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A checkpoint's weights into `model`: all of them, or with LoRA exactly its trained ones."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(state) != trained:
        raise UsageError(
            f"the checkpoint's weights are not this run's LoRA adapters ({len(set(state) ^ trained)} names differ, "
            f"for example {sorted(set(state) ^ trained)[0]!r}); use another --output-dir or checkpoint.resume=false"
        )
    model.load_state_dict(state, strict=False)


def save_model(model: torch.nn.Module, target: Path, state_dict: dict[str, torch.Tensor], recipe: Recipe) -> None:
    """`model.save_pretrained` from `state_dict` (the whole model's host copies): with LoRA peft's adapter folder,
    and with model.lora.save_merged the base with the adapters merged in beside it (`model-merged/`)."""
    model.save_pretrained(str(target), state_dict=state_dict)
    if is_lora(model) and recipe.model.lora is not None and recipe.model.lora.save_merged:
        merged_model(model, state_dict).save_pretrained(str(target.parent / MERGED_DIR))


def merged_model(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The base with the adapters merged in (peft's `merge_and_unload`), built on the host from `state_dict`: a
    skeleton on the meta device takes the host copies as its tensors, so the trained model, wherever it is,
    is neither copied nor moved."""
    import copy

    from peft import get_peft_model  # lazy: peft imports transformers

    base = model.get_base_model()
    with torch.device("meta"):
        skeleton = type(base)._from_config(copy.deepcopy(base.config))
    wrapped = get_peft_model(skeleton, copy.deepcopy(model.peft_config["default"]))
    wrapped.load_state_dict(state_dict, assign=True)
    return wrapped.merge_and_unload()
