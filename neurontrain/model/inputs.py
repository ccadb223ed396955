"""How the loop calls a model, decided once at set-up from what the model accepts (pure logic; the facts come
from `model/input_probe.py`, which reads the forward's signature and runs a tiny copy of the model on eager CPU).

- The attention mask: a ready 4D additive mask where the model honours one the same as its 2D 0/1 mask
  (transformers 5 otherwise inspects a 2D mask's values, `mask.all()`, on every forward: a host sync and one
  more graph per shape on XLA), else the 2D mask (DeBERTa-v2 reads its mask as 0/1 and multiplies embeddings
  by it).
- `use_cache=False` for every causal LM whose forward takes `use_cache`: a training forward has no use for a
  KV cache, and a sliding-window cache slices its last `sliding_window` keys, which XLA rejects.
- Packing: a decoder packs where a 4D per-document mask with restarting position ids gives each document the
  outputs it has alone; an encoder also needs a per-document head (`model/packed.py: PACKED_HEADS`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

MASK_2D, MASK_4D = "2d", "4d"


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What was read from the model: its forward's parameter names and the eager CPU checks' results."""

    model_type: str
    causal: bool  # a causal LM (else a sequence classifier)
    forward_params: frozenset[str]
    mask_4d_equivalent: bool  # unpacked: a (rows, 1, 1, length) additive mask gives the 2D mask's outputs
    packed_equivalent: bool  # per-document 4D mask + positions gives each document its outputs alone
    sliding_window: int | None = None  # the shortest attention window of any layer, None: no window
    has_packed_head: bool = False  # a per-document classification head is written for this model type
    position_offset: int = 0  # where the positions that passed the packed check start


@dataclass(frozen=True, kw_only=True)
class ModelInputs:
    mask: str = MASK_2D  # "4d": a ready additive mask; "2d": the 0/1 padding mask
    use_cache: bool = False  # pass use_cache=False (the forward takes it)
    position_ids: bool = False  # the forward takes position_ids
    token_type_ids: bool = False  # the forward takes token_type_ids (the loop leaves them at the model's zeros)
    unpackable: str | None = None  # why packing cannot train this model; None: it packs
    sliding_window: int | None = None  # packed rows longer than this are refused
    position_offset: int = 0  # a packed document's first position (RoBERTa's pad_token_id + 1)

    def __post_init__(self) -> None:
        if self.mask not in (MASK_2D, MASK_4D):
            raise ValueError(f"ModelInputs.mask: {self.mask!r} is not {MASK_2D!r} or {MASK_4D!r}")


def _unpackable(facts: ModelFacts) -> str | None:
    what = "causal-lm" if facts.causal else "sequence-classification"
    if "position_ids" not in facts.forward_params:
        return f"{facts.model_type}'s forward takes no position_ids (documents cannot restart their positions)"
    if not facts.causal and not facts.mask_4d_equivalent:
        return f"{facts.model_type} does not honour a 4D additive attention mask (it reads its mask as 0/1)"
    if not facts.causal and not facts.has_packed_head:
        return f"no per-document classification head is written for {facts.model_type}"
    if not facts.packed_equivalent:
        return (
            f"{facts.model_type} ({what}) does not give a packed document the outputs it has alone under a "
            "per-document 4D mask"
        )
    return None


def decide_inputs(facts: ModelFacts) -> ModelInputs:
    """The inputs the loop gives this model, from what it accepts. A causal LM keeps the 2D mask unpacked (its
    causal mask is built from it without a host sync); an encoder gets the ready 4D mask where equivalent."""
    params = facts.forward_params
    four_d = not facts.causal and facts.mask_4d_equivalent
    return ModelInputs(
        mask=MASK_4D if four_d else MASK_2D,
        use_cache=facts.causal and "use_cache" in params,
        position_ids="position_ids" in params,
        token_type_ids="token_type_ids" in params,
        unpackable=_unpackable(facts),
        sliding_window=facts.sliding_window,
        position_offset=facts.position_offset,
    )


def sliding_window_of(config_values: dict, layer_types: Collection[str] | None) -> int | None:
    """The attention window a packed row must fit: the config's `sliding_window` where some layer uses it
    (`layer_types` naming sliding attention, or `use_sliding_window`, or no layer types at all), else None."""
    window = config_values.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return None
    if config_values.get("use_sliding_window") is False:
        return None
    if layer_types is not None and not any("sliding" in t for t in layer_types):
        return None
    return window
