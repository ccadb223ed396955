"""The facts `model/inputs.py` decides from, read once at set-up: the forward's parameter names, and, on a
copy of the model cut to two layers on the eager CPU path (never XLA), whether a ready 4D additive mask gives
the outputs of the 2D mask and whether a per-document 4D mask with restarting positions gives each of two
documents in one row the outputs it has alone."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from neurontrain.logs import get_logger
from neurontrain.model.inputs import ModelFacts, ModelInputs, decide_inputs, sliding_window_of
from neurontrain.model.packed import PACKED_HEADS, packed_attention_mask

log = get_logger(__name__)

PROBE_LAYERS = 2
DOCS = (5, 4)  # two documents in one row, then padding
PAD = 3
TOLERANCE = 1e-4  # of the outputs' largest magnitude (eager fp32: the differences are rounding)
_DECIDED: dict[tuple, ModelInputs] = {}  # per config, task and attention implementation, in this process


def forward_params(model: torch.nn.Module) -> frozenset[str]:
    """The named parameters of the model's forward (not **kwargs)."""
    params = inspect.signature(type(model).forward).parameters.values()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def probe_config(config: Any) -> Any:
    """The config with at most PROBE_LAYERS layers (their layer types cut to match), no dropout effects (the
    model runs in eval mode)."""
    small = copy.deepcopy(config)
    layers = getattr(small, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > PROBE_LAYERS:
        small.num_hidden_layers = PROBE_LAYERS
        if isinstance(getattr(small, "layer_types", None), list):
            small.layer_types = small.layer_types[:PROBE_LAYERS]
    return small


def _output(model: torch.nn.Module, causal: bool, extra: dict, **inputs: Any) -> torch.Tensor:
    """A causal LM's logits, an encoder's last hidden states."""
    if causal:
        return model(**inputs, **extra).logits
    return model(**inputs, **extra, output_hidden_states=True).hidden_states[-1]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(a.abs().max().item(), b.abs().max().item(), 1.0)
    return bool(torch.isfinite(a).all() and torch.isfinite(b).all()) and (a - b).abs().max().item() <= TOLERANCE * scale


def _probe_tokens(config: Any) -> tuple[list[torch.Tensor], int]:
    """Two documents of ordinary tokens (no special id: RoBERTa numbers positions by its pad id), and the pad id."""
    special = {getattr(config, name, None) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}
    ordinary = torch.tensor([i for i in range(min(config.vocab_size, 1000)) if i not in special])
    if len(ordinary) == 0:  # a vocabulary of special tokens only
        ordinary = torch.arange(min(config.vocab_size, 1000))
    generator = torch.Generator().manual_seed(0)
    docs = [ordinary[torch.randint(0, len(ordinary), (n,), generator=generator)] for n in DOCS]
    pad = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
    return docs, pad


def _packed_equivalent(
    model: torch.nn.Module, causal: bool, extra: dict, sample: tuple[list[torch.Tensor], int], offset: int = 0
) -> bool:
    docs, pad = sample
    ids = torch.cat([*docs, torch.full((PAD,), pad)])[None]
    document_ids = torch.cat([torch.full((len(d),), i + 1) for i, d in enumerate(docs)] + [torch.zeros(PAD)])
    positions = torch.cat([torch.arange(len(d)) for d in docs] + [torch.arange(PAD)])[None] + offset
    mask = packed_attention_mask(document_ids[None].long(), causal, torch.float32)
    packed = _output(model, causal, extra, input_ids=ids, attention_mask=mask, position_ids=positions)[0]
    start = 0
    for doc in docs:
        alone = _output(model, causal, extra, input_ids=doc[None], attention_mask=torch.ones(1, len(doc)))[0]
        if not _close(packed[start : start + len(doc)], alone):
            return False
        start += len(doc)
    return True


def _mask_4d_equivalent(
    model: torch.nn.Module, causal: bool, extra: dict, sample: tuple[list[torch.Tensor], int]
) -> bool:
    (doc, _), pad = sample
    ids = torch.cat([doc, torch.full((PAD,), pad)])[None]
    mask = torch.cat([torch.ones(len(doc)), torch.zeros(PAD)])[None]
    additive = (1.0 - mask[:, None, None, :]) * torch.finfo(torch.float32).min
    two_d = _output(model, causal, extra, input_ids=ids, attention_mask=mask.long())[0, : len(doc)]
    four_d = _output(model, causal, extra, input_ids=ids, attention_mask=additive)[0, : len(doc)]
    return _close(two_d, four_d)


def _position_offsets(config: Any) -> list[int]:
    """Where a document's positions may start: 0, or after the padding index (RoBERTa numbers its positions
    from pad_token_id + 1)."""
    pad = getattr(config, "pad_token_id", None)
    return [0] + ([pad + 1] if isinstance(pad, int) and pad >= 0 else [])


def _checked(check: Any, *args: Any) -> bool:
    """A check that raises (a model refusing a 4D mask or position ids) is a check that fails."""
    try:
        with torch.no_grad():
            return check(*args)
    except Exception as exc:
        log.debug("model input check %s failed: %s", check.__name__, exc)
        return False


def _probe(config: Any, causal: bool, attn_implementation: str | None) -> ModelInputs:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification  # lazy: a second to import

    model_type = config.model_type
    auto = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
    seed = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = auto.from_config(probe_config(config), attn_implementation=attn_implementation).eval()
    finally:
        torch.random.set_rng_state(seed)
    params = forward_params(model)
    extra = {"use_cache": False} if causal and "use_cache" in params else {}
    sample = _probe_tokens(config)
    offsets = _position_offsets(config) if "position_ids" in params else []
    offset = next((o for o in offsets if _checked(_packed_equivalent, model, causal, extra, sample, o)), None)
    facts = ModelFacts(
        model_type=model_type,
        causal=causal,
        forward_params=params,
        mask_4d_equivalent=not causal and _checked(_mask_4d_equivalent, model, causal, extra, sample),
        packed_equivalent=offset is not None,
        position_offset=offset or 0,
        sliding_window=sliding_window_of(config.to_dict(), getattr(config, "layer_types", None)),
        has_packed_head=model_type in PACKED_HEADS,
    )
    return decide_inputs(facts)


def probe_model_inputs(config: Any, task: str, attn_implementation: str | None) -> ModelInputs:
    """How the loop calls the model `config` builds for `task` (checked once per config in a process)."""
    key = (config.to_json_string(use_diff=False), task, attn_implementation)
    if key not in _DECIDED:
        _DECIDED[key] = _probe(config, task == "causal-lm", attn_implementation)
    return _DECIDED[key]
