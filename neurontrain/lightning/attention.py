"""Hugging Face models inside a LightningModule, given attention masks that trace the same graph every step.

Before attention, transformers asks whether the 2D attention mask can be dropped (`padding_mask.all()` in
Python, for bidirectional and causal masks, eager and SDPA attention alike). On a lazy device that is a graph
launched and read on the host inside every forward, and a batch without padding would trace a graph of its own
(no mask). `neurontrain run` hands such models a ready 4D mask; a Lightning script's module builds its own
inputs, so here the model is switched, through transformers' public attention registries
(`AttentionInterface`, `AttentionMaskInterface`), to an implementation named `neurontrain_sdpa`: transformers'
own SDPA attention with its own SDPA mask, the mask always built (never skipped). Same outputs (it is the
computation SDPA does with a mask), no host read, one graph.
"""

from __future__ import annotations

from typing import Any

from neurontrain.logs import get_logger

log = get_logger(__name__)

NAME = "neurontrain_sdpa"
SWITCHED = ("sdpa", "eager")  # implementations whose masks may be skipped after a host read; flash/flex left alone


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def always_built_mask(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_is_bidirectional_skip"] = False
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(NAME, ALL_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register(NAME, always_built_mask)


def static_masks(module: Any) -> list[str]:
    """Every Hugging Face model in `module` on eager or SDPA attention switched to `neurontrain_sdpa`; returns
    their names. A module without one is left alone (transformers is not imported)."""
    models = [
        (name, sub)
        for name, sub in module.named_modules()
        if callable(getattr(sub, "set_attn_implementation", None))
        and getattr(getattr(sub, "config", None), "_attn_implementation", None) in SWITCHED
    ]
    if not models:
        return []
    _register()
    switched = []
    for name, sub in models:
        if sub.config._attn_implementation not in SWITCHED:  # a model inside one already switched
            continue
        try:
            sub.set_attn_implementation(NAME)
        except (ValueError, NotImplementedError) as exc:  # a model transformers will not give SDPA
            log.warning(f"lightning: {name or type(sub).__name__} keeps its attention ({exc}): a host read per step")
            continue
        switched.append(name or type(sub).__name__)
    if switched:
        log.info(f"lightning: Hugging Face attention with masks always built in {', '.join(switched)}")
    return switched
