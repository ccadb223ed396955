"""The recipe's fine-tuning settings: TRL's data formats and which tokens the loss is on (data.format, data.loss_on,
data.chat_template; data/sft.py) and LoRA adapters (model.lora; model/lora.py). recipe.py holds them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# TRL's dataset formats (data/sft.py): a text field, a `messages` conversation, or `prompt` + `completion`
DataFormat = Literal["auto", "text", "messages", "prompt-completion"]
# which tokens the loss is on; auto: TRL's choice for the format (text: all, prompt-completion: completion,
# messages: the assistant turns)
LossOn = Literal["auto", "all", "completion", "assistant"]
SFT_DEFAULTS = {"format": "auto", "loss_on": "auto", "chat_template": None}


class SFTDataFields(BaseModel):
    """The data section's SFT settings (recipe.py's DataSpec has them)."""

    format: DataFormat = "auto"
    loss_on: LossOn = "auto"
    chat_template: str | None = None  # a Jinja file, or chatml (the toolkit's: it marks assistant turns); None: own


class LoraSpec(BaseModel):
    """LoRA adapters through peft (model/lora.py): the base frozen, only the adapters (and modules_to_save) train."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] | None = None  # None: peft's default for the model type
    modules_to_save: list[str] = []
    use_rslora: bool = False  # scale alpha / sqrt(r) instead of alpha / r
    save_merged: bool = False  # also write <output>/model-merged: the base with the adapters merged in


def sft_defaults(data: Any) -> set[str]:
    """The SFT settings of a data section left at their default (the fingerprints leave them out: settings
    added later)."""
    return {key for key, value in SFT_DEFAULTS.items() if getattr(data, key) == value}


def check_sft(data: Any) -> None:
    """loss_on values the declared format cannot honour (auto resolves once the data's fields are known)."""
    fmt, loss_on = data.format, data.loss_on
    if loss_on == "completion" and fmt in ("text", "messages"):
        raise ValueError(f"data.loss_on: completion needs prompt-completion data (data.format is {fmt})")
    if loss_on == "assistant" and fmt == "text":
        raise ValueError("data.loss_on: assistant needs conversations (data.format is text)")
    if fmt not in ("auto", "text") and data.service.kind != "none":
        raise ValueError(f"data.format {fmt} is tokenized in the training processes: no data.service")
    if fmt not in ("auto", "text") and data.streaming:
        raise ValueError(f"data.streaming reads text: data.format {fmt} does not stream")


def unset_lora(recipe: Any) -> dict:
    """What a fingerprint leaves out of a recipe without model.lora (a setting added later, at its default)."""
    return {"model": {"lora"}} if recipe.model.lora is None else {}


def check_fine_tuning(recipe: Any) -> None:
    """What the SFT formats and LoRA do not (yet) combine with."""
    data = recipe.data
    if recipe.task != "causal-lm" and (data.format not in ("auto", "text") or data.loss_on != "auto"):
        raise ValueError(f"data.format and data.loss_on are for causal-lm: task {recipe.task} reads text")
    if recipe.model.lora is not None and (recipe.parallel.tp not in ("auto", 1) or recipe.parallel.fsdp):
        raise ValueError("model.lora trains on one worker or data parallel: not yet under parallel.tp or fsdp")
