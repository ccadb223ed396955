"""A checkpoint's tensors as transformers converts them on load: the tensors one of its `WeightConverter`s merges
(Mixtral's per-expert `block_sparse_moe.experts.E.w1/w2/w3.weight`, as `save_pretrained` and the hub store them)
presented as the merged tensor under the name transformers loads it as (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`).

The merge is transformers' own: a copy of the converter collects the source tensors per source pattern in the
order transformers' loader gives them (checkpoint names in natural order) and runs its operations. A merged
tensor's shape and dtype come from running those operations on meta tensors of the sources' shapes (no data
read); its data is read and merged when it is read (a slice of it merges the whole tensor, kept until another is
merged: one merged tensor, one layer's experts, in memory at a time). Converters with operations other than
MergeModulelist and Concatenate, or with several targets, are left alone: their tensors stay under their own
names and matching refuses them naming one (matching.py).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from neurontrain.checkpoint.formats import TensorSource
from neurontrain.errors import UsageError, first_line

if TYPE_CHECKING:
    from transformers.core_model_loading import WeightConverter, WeightRenaming


def supported(converter: WeightConverter) -> bool:
    """Whether ConvertedSource applies the converter: many (or one) to one, merging operations only."""
    # lazy: importing transformers' loading machinery changes the graphs a process traces afterwards
    from transformers.core_model_loading import Concatenate, MergeModulelist

    return len(converter.target_patterns) == 1 and all(
        isinstance(op, (MergeModulelist, Concatenate)) for op in converter.operations
    )


@dataclass
class _Merge:
    converter: WeightConverter
    sources: dict[str, list[str]] = field(default_factory=dict)  # the converter's source pattern -> checkpoint names


class ConvertedSource:
    """`raw`'s tensors, with those a supported converter merges replaced by the merged tensors (named as
    transformers names them after its renamings and the converter); every other tensor under its own name."""

    def __init__(
        self, raw: TensorSource, renamings: tuple[WeightRenaming, ...], converters: tuple[WeightConverter, ...]
    ) -> None:
        self.raw, self.description = raw, raw.description
        self.merged = _merges(raw.keys(), list(renamings), [c for c in converters if supported(c)])
        consumed = {key for merge in self.merged.values() for keys in merge.sources.values() for key in keys}
        self._keys = [k for k in raw.keys() if k not in consumed] + list(self.merged)
        self._meta = {name: self._meta_of(name) for name in self.merged}
        self._last: tuple[str, torch.Tensor] | None = None

    def __getattr__(self, name: str):  # config, layout, writer, optimizer ... of the checkpoint itself
        raw = self.__dict__.get("raw")
        if raw is None:
            raise AttributeError(name)
        return getattr(raw, name)

    def keys(self) -> list[str]:
        return list(self._keys)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self._meta[name] if name in self._meta else self.raw.meta(name)

    def get(self, name: str) -> torch.Tensor:
        return self._convert(name, self.raw.get) if name in self.merged else self.raw.get(name)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """A slice of a merged tensor merges it whole; the last one merged is kept for the next slice of it (a
        rank's piece of gate_up_proj is two ranges), let go before another is merged."""
        if name not in self.merged:
            return self.raw.get_slice(name, dim, start, stop)
        if self._last is None or self._last[0] != name:
            self._last = None
            self._last = name, self.get(name)
        return self._last[1].narrow(dim, start, stop - start).clone()

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        return self.raw.optimizer_state()

    def _meta_of(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        def empty(key: str) -> torch.Tensor:
            shape, dtype = self.raw.meta(key)
            return torch.empty(shape, dtype=dtype, device="meta")

        merged = self._convert(name, empty)
        return tuple(merged.shape), merged.dtype

    def _convert(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The merged tensor `name`, its sources read by `read`, through a fresh copy of transformers' converter."""
        merge = self.merged[name]
        converter = copy.deepcopy(merge.converter)
        for pattern, keys in merge.sources.items():
            for key in keys:
                converter.add_tensor(name, key, pattern, functools.partial(read, key))
        first = next(iter(merge.sources.values()))[0]
        try:
            out = converter.convert(name)
        except Exception as exc:
            raise UsageError(
                f"{self.description}: transformers' conversion of {first} (and the tensors merged with it) into "
                f"{name} failed: {first_line(exc, 200)}"
            ) from None
        if set(out) != {name}:
            raise UsageError(f"{self.description}: transformers' conversion of {first} gave {sorted(out)}, not {name}")
        tensor = out[name]
        return tensor[0] if isinstance(tensor, list) else tensor


def _merges(keys: list[str], renamings: list[WeightRenaming], converters: list[WeightConverter]) -> dict[str, _Merge]:
    """{the merged tensor's name: its converter and sources}, the sources in the order transformers' loader
    collects them (natural order of the checkpoint names)."""
    if not converters:
        return {}
    from transformers.core_model_loading import apply_converters, apply_renamings, dot_natural_key  # lazy: as above

    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    merges: dict[str, _Merge] = {}
    for key in sorted(keys, key=dot_natural_key):
        target, pattern = apply_converters(apply_renamings(key, renamings), converters)
        if pattern is not None:
            merge = merges.setdefault(target, _Merge(by_pattern[pattern]))
            merge.sources.setdefault(pattern, []).append(key)
    return merges
