"""The names the family's save_pretrained writes a model's tensors under: transformers' load-time renamings reversed,
as its revert_weight_conversion reverses them for a model not loaded by from_pretrained (GPT-NeoX: the model's
`lm_head.weight` is saved as `embed_out.weight`). `checkpoint migrate --to gpu` writes these names."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

import torch

from neurontrain.checkpoint.matching import converted_key, model_from_config, renamed_key
from neurontrain.fact_cache import read_fact, write_fact

if TYPE_CHECKING:
    from transformers.core_model_loading import WeightConverter, WeightRenaming


@functools.lru_cache(maxsize=8)
def _saving_transforms(config_json: str) -> tuple[tuple[WeightRenaming, ...], tuple[WeightConverter, ...]]:
    """The renamings and converters save_pretrained applies, as transformers' revert_weight_conversion builds them
    for a model not loaded by from_pretrained: the load-time mapping without legacy entries and prefix changes,
    reversed."""
    with torch.device("meta"):
        model = model_from_config(json.loads(config_json))
    from transformers.conversion_mapping import get_model_conversion_mapping  # lazy: see matching._conversions
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

    mapping = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
    reverse = [t.reverse_transform() for t in mapping[::-1]]
    return (
        tuple(t for t in reverse if isinstance(t, WeightRenaming)),
        tuple(t for t in reverse if isinstance(t, WeightConverter)),
    )


def _saved_name(name: str, renamings: list, converters: list) -> str:
    if not renamings or (converters and converted_key(name, converters)[1] is not None):
        return name
    return renamed_key(name, renamings)


def saved_names(names: list[str], config: dict) -> dict[str, str]:
    """{model name: the name the family's save_pretrained writes it under} (GPT-NeoX: lm_head.weight ->
    embed_out.weight; kept in the fact cache). Tensors transformers' converters merge keep the model's name (the
    merged tensor; transformers loads it as it is)."""
    material = {"config": config, "keys": names}
    renamed = read_fact("saved-names", material)
    if renamed is None or len(renamed) != len(names):
        renamings, converters = map(list, _saving_transforms(json.dumps(config, sort_keys=True)))
        renamed = [_saved_name(name, renamings, converters) for name in names]
        write_fact("saved-names", material, renamed)
    return dict(zip(names, renamed))
