"""Names by matching the model, never by guessing.

The target model is built from its config on the meta device (no memory, no weights); its state dict gives
the names and shapes a checkpoint must cover. A mapping strips a prefix from the checkpoint's names and adds
one (`model.model.layers.0...` of a LightningModule -> `model.layers.0...`); the mapping used is the one, and
only one, under which the checkpoint covers every model tensor with the right shape (tied tensors: either
name). Before matching, each checkpoint name is renamed as transformers renames it on load (its conversion
mapping's renamings: GPT-NeoX's `embed_out.weight` is the model's `lm_head.weight`), and the tensors its
converters merge are merged by those converters (converted.py: Mixtral's per-expert w1/w2/w3 into
`mlp.experts.gate_up_proj` and `down_proj`), so names a checkpoint written by transformers holds match the model
it loads into; a converter that is not applied is refused naming a tensor it converts. Entries the mapping
leaves over (optimizer state, step counters, other modules) are reported, not converted. No fit or several:
UsageError naming the closest candidates. `check_loads` holds names and shapes against the model's state dict as
`load_state_dict(strict=True)` does, which migrate runs on its output before publishing it. What is read of the
model (names, shapes, tied groups, orders, whether converters apply, the renamed keys) is kept in the fact cache
(fact_cache.py): the next migration of a model of the same config imports no modeling module.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import transformers

from neurontrain.checkpoint.converted import ConvertedSource, supported
from neurontrain.checkpoint.formats import TensorSource, optimizer_by_name
from neurontrain.errors import NeurontrainError, UsageError
from neurontrain.fact_cache import read_fact, write_fact

if TYPE_CHECKING:
    from transformers.core_model_loading import WeightConverter, WeightRenaming


def model_from_config(config: dict) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("transformers_version",)})
    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        cls = transformers.AutoModelForCausalLM if cfg.model_type != "bert" else transformers.AutoModel
        return cls.from_config(cfg)
    return cls(cfg)


def architecture(config: dict) -> str:
    return (config.get("architectures") or [config.get("model_type", "model")])[0]


@dataclass(frozen=True)
class ModelNames:
    shapes: dict[str, tuple[int, ...]]  # the state dict's names, in model order
    groups: list[list[str]]  # names of one tensor (tied weights share one), the first is the canonical name
    orders: list[list[str]]  # canonical parameter names in the orders optimizers are built in


@dataclass(frozen=True)
class _Facts:
    names: ModelNames
    converters: bool  # transformers merges or splits tensors of this model on load: matching builds the model


@functools.lru_cache(maxsize=8)
def _facts(config_json: str) -> _Facts:
    """What matching reads of the config's model, from the fact cache (fact_cache.py) or by building it on the
    meta device (then stored: the next migration of this model imports no modeling module)."""
    stored = read_fact("model-names", json.loads(config_json))
    if stored is None:
        with torch.device("meta"):
            model = model_from_config(json.loads(config_json))
        state = model.state_dict(keep_vars=True)
        by_tensor: dict[int, list[str]] = {}
        for name, tensor in state.items():
            by_tensor.setdefault(id(tensor), []).append(name)
        params = [n for n, _ in model.named_parameters()]
        matrices = [n for n in params if state[n].ndim >= 2]
        orders = [params, matrices + [n for n in params if n not in matrices]]
        shapes = [[n, list(t.shape)] for n, t in state.items()]
        converters = bool(_conversions(config_json)[1])
        stored = {"shapes": shapes, "groups": list(by_tensor.values()), "orders": orders, "converters": converters}
        write_fact("model-names", json.loads(config_json), stored)
    shapes = {n: tuple(shape) for n, shape in stored["shapes"]}
    return _Facts(ModelNames(shapes, stored["groups"], stored["orders"]), stored["converters"])


def _model_names(config_json: str) -> ModelNames:
    return _facts(config_json).names


def model_names(config: dict) -> ModelNames:
    return _model_names(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _conversions(config_json: str) -> tuple[tuple[WeightRenaming, ...], tuple[WeightConverter, ...]]:
    """The renamings transformers applies to checkpoint names when it loads the config's model, and the
    converters that merge or split tensors (those merging only are applied: converted.py)."""
    with torch.device("meta"):
        model = model_from_config(json.loads(config_json))
    # lazy: importing transformers' loading machinery changes the graphs a process traces afterwards
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(model)
    renamings = tuple(t for t in mapping if isinstance(t, WeightRenaming))
    return renamings, tuple(t for t in mapping if isinstance(t, WeightConverter))


def _renamings(config_json: str) -> tuple[WeightRenaming, ...]:
    return _conversions(config_json)[0]


def needs_conversion(keys: list[str], config: dict) -> tuple[str, str, str] | None:
    """(checkpoint name, the model name transformers converts it into, the converter's operations) of the first
    entry that a converter ConvertedSource does not apply would convert on load, or None."""
    converters = [c for c in _conversions(json.dumps(config, sort_keys=True))[1] if not supported(c)]
    for key in keys:
        target, pattern = converted_key(key, converters)
        if pattern is not None:
            ops = ", ".join(
                type(op).__name__ for op in next(c for c in converters if pattern in c.source_patterns).operations
            )
            return key, target, ops
    return None


def converted(raw: TensorSource, config: dict) -> TensorSource:
    """`raw` with the tensors transformers merges on load merged (converted.py), or `raw` when it holds none."""
    if not _facts(json.dumps(config, sort_keys=True)).converters:
        return raw
    renamings, converters = _conversions(json.dumps(config, sort_keys=True))
    source = ConvertedSource(raw, renamings, converters)
    return source if source.merged else raw


def loaded_names(keys: list[str], config: dict) -> dict[str, str]:
    """{the name transformers loads a checkpoint entry under: the entry's name}, the first entry winning (the
    renamed keys kept in the fact cache)."""
    material = {"config": config, "keys": keys}
    renamed = read_fact("loaded-names", material)
    if renamed is None or len(renamed) != len(keys):
        renamings = list(_renamings(json.dumps(config, sort_keys=True)))
        renamed = [renamed_key(key, renamings) if renamings else key for key in keys]
        write_fact("loaded-names", material, renamed)
    out: dict[str, str] = {}
    for name, key in zip(renamed, keys):
        out.setdefault(name, key)
    return out


class RenamedSource:
    """A checkpoint's tensors under the names transformers' load-time renames give them."""

    def __init__(self, raw: TensorSource, config: dict) -> None:
        self.raw, self.description = raw, raw.description
        merged = getattr(raw, "merged", {})  # merged tensors are named as transformers loads them already
        self.names = loaded_names([k for k in raw.keys() if k not in merged], config) | {k: k for k in merged}

    def keys(self) -> list[str]:
        return list(self.names)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self.raw.meta(self.names[name])


@functools.lru_cache(maxsize=8)
def _trainer_order(config_json: str) -> tuple[str, ...]:
    """The transformers Trainer's optimizer grouping: weight-decayed parameters first (importing the Trainer
    takes seconds: only for an optimizer state without names)."""
    with torch.device("meta"):
        model = model_from_config(json.loads(config_json))
    params = [n for n, _ in model.named_parameters()]
    try:
        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    except Exception:  # a Trainer without this helper, or without accelerate: the other orders remain
        return tuple(params)
    return tuple([n for n in params if n in decay] + [n for n in params if n not in decay])


@dataclass
class Candidate:
    strip: str
    add: str
    chosen: dict[str, str] = field(default_factory=dict)  # canonical model name -> checkpoint name
    missing: list[str] = field(default_factory=list)
    wrong_shape: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return bool(self.chosen) and not self.missing and not self.wrong_shape

    def describe(self, total: int) -> str:
        how = f"strip {self.strip!r}" + (f", add {self.add!r}" if self.add else "")
        bad = self.missing[:2] or [f"{n} (shape)" for n in self.wrong_shape[:2]]
        return f"{how}: {len(self.chosen)} of {total} tensors" + (f", lacking {', '.join(bad)}" if bad else "")


def _suffix_pair(key: str, name: str) -> tuple[str, str] | None:
    a, b = key.split("."), name.split(".")
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    if n < min(2, len(b)):  # a module and a tensor name in common (`q_proj.weight`), or the whole name
        return None
    return "".join(p + "." for p in a[: len(a) - n]), "".join(p + "." for p in b[: len(b) - n])


def _evaluate(source: TensorSource | RenamedSource, names: ModelNames, strip: str, add: str) -> Candidate:
    mapped = {add + k[len(strip) :]: k for k in source.keys() if k.startswith(strip)}
    cand = Candidate(strip, add)
    for group in names.groups:
        present = [n for n in group if n in mapped]
        if not present:
            cand.missing.append(group[0])
        elif source.meta(mapped[present[0]])[0] != names.shapes[group[0]]:
            cand.wrong_shape.append(group[0])
        else:
            cand.chosen[group[0]] = mapped[present[0]]
    return cand


def find_mapping(source: TensorSource | RenamedSource, config: dict) -> Candidate:
    names = model_names(config)
    keys = source.keys()
    seeds = [g[0] for g in names.groups if not any(p.isdigit() for p in g[0].split("."))] + list(names.shapes)[:8]
    pairs = {pair for seed in seeds for k in keys if (pair := _suffix_pair(k, seed)) is not None}
    candidates = [_evaluate(source, names, strip, add) for strip, add in sorted(pairs)]
    fits: dict[frozenset, Candidate] = {}
    for cand in candidates:
        if cand.fits:
            fits.setdefault(frozenset(cand.chosen.items()), cand)
    total, arch = len(names.groups), architecture(config)
    if len(fits) == 1:
        return next(iter(fits.values()))
    if fits:
        ways = "; ".join(c.describe(total) for c in fits.values())
        raise UsageError(
            f"{source.description}: its names fit the {arch} model in {len(fits)} ways ({ways}); keep one copy of "
            "the model in the checkpoint"
        )
    unapplied = needs_conversion(keys, config)
    if unapplied is not None:
        stored = getattr(source, "names", {}).get(unapplied[0], unapplied[0])
        raise UsageError(
            f"{source.description}: {stored} is one of the tensors transformers converts into {unapplied[1]} on "
            f"load ({arch}) by {unapplied[2]}, which migrate does not apply: pass a checkpoint holding the model's "
            "own tensors"
        )
    closest = sorted(candidates, key=lambda c: -len(c.chosen))[:2]
    detail = "; ".join(c.describe(total) for c in closest) or f"first name {keys[0] if keys else 'none'}"
    raise UsageError(
        f"{source.description}: no mapping of its {len(keys)} tensor names covers the {arch} model of the config "
        f"(closest: {detail}); pass --config with the config of the model it holds"
    )


class MappedSource:
    """A checkpoint's tensors under the model's own names (the mapping found by find_mapping)."""

    def __init__(self, raw: TensorSource, config: dict) -> None:
        self.raw, self.config = converted(raw, config), config
        self.description, self.layout, self.writer = raw.description, raw.layout, raw.writer
        raw = self.raw
        renamed = RenamedSource(raw, config)
        self.mapping = find_mapping(renamed, config)
        self._names = model_names(config)
        self._keys = {name: renamed.names[key] for name, key in self.mapping.chosen.items()}
        used = set(self._keys.values())
        self.extras = [k for k in raw.keys() if k not in used]
        merges = getattr(raw, "merged", {})  # what transformers' converters merged: {merged name: its sources}
        self.merged = {name: [k for ks in merges[name].sources.values() for k in ks] for name in merges if name in used}

    def keys(self) -> list[str]:
        return list(self._keys)

    def stored_names(self) -> dict[str, str] | None:
        """{model name: the checkpoint's own name} where the checkpoint names the model's tensors as a Hugging
        Face folder does (no prefix stripped or added), else None."""
        if self.mapping.strip or self.mapping.add:
            return None
        return dict(self._keys)

    def get(self, name: str) -> torch.Tensor:
        return self.raw.get(self._keys[name])

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.raw.get_slice(self._keys[name], dim, start, stop)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self.raw.meta(self._keys[name])

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        torch_form = getattr(self.raw, "optimizer", None)
        named = self._name_torch_form(torch_form) if torch_form is not None else self.raw.optimizer_state()
        if named is None:
            return None
        out = {}
        for name, key in self._keys.items():
            parts = key.split(".")
            for candidate in [".".join(parts[i:]) for i in range(len(parts))] + [name]:
                if candidate in named:
                    out[name] = named[candidate]
                    break
        return out

    def _name_torch_form(self, state: dict) -> dict[str, dict[str, torch.Tensor]]:
        groups = state.get("param_groups", [])
        indices = [i for g in groups for i in g["params"]]
        if any("param_names" in g for g in groups) or (indices and isinstance(indices[0], str)):
            return optimizer_by_name(state, [])

        def fit(orders: list) -> list[list[str]]:
            found: list[list[str]] = []
            for order in orders:
                keys = [self._keys[n] for n in order if n in self._keys]
                if (
                    keys not in found
                    and len(keys) == len(indices)
                    and all(
                        tuple(state["state"][i]["exp_avg"].shape) == self.raw.meta(k)[0]
                        for k, i in zip(keys, indices)
                        if i in state["state"] and "exp_avg" in state["state"][i]
                    )
                ):
                    found.append(keys)
            return found

        fitting = fit(self._names.orders) or fit([_trainer_order(json.dumps(self.config, sort_keys=True))])
        if len(fitting) != 1:
            raise UsageError(
                f"{self.description}: the optimizer state holds no parameter names and "
                f"{'no' if not fitting else 'more than one'} parameter order of the model fits its "
                f"{len(indices)} entries; save the optimizer built from named_parameters() (torch>=2.6 keeps names)"
            )
        return optimizer_by_name(state, fitting[0])


def check_loads(config: dict, shapes: dict[str, tuple[int, ...]], what: str) -> None:
    """What `load_state_dict(strict=True)` of these names and shapes into the config's model refuses (missing
    keys, unexpected keys, size mismatches), against the model's state dict (a tied tensor under any of its
    names); a NeurontrainError if anything."""
    problem = load_problem(model_names(config), shapes)
    if problem:
        raise NeurontrainError(
            f"{what} would not load into {architecture(config)} with strict=True, so it was not written: "
            f"{problem[:300]}"
        )


def load_problem(names: ModelNames, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The refusal of a strict load, in load_state_dict's words, or None (pure)."""
    given = dict(shapes)
    for group in names.groups:
        present = next((n for n in group if n in given), None)
        for n in group:
            if present is not None and n not in given:
                given[n] = given[present]
    missing = [n for n in names.shapes if n not in given]
    unexpected = [n for n in given if n not in names.shapes]
    parts = [f"{kind} key(s) in state_dict: " + ", ".join(f'"{n}"' for n in found) + "." for kind, found in (
        ("Missing", missing), ("Unexpected", unexpected)) if found]  # fmt: skip
    parts += [
        f"size mismatch for {n}: copying a param with shape {list(given[n])}, the shape in current model is "
        f"{list(want)}."
        for n, want in names.shapes.items()
        if n in given and tuple(given[n]) != tuple(want)
    ]
    return " ".join(parts) or None


def converted_key(key: str, converters: list) -> tuple:
    from transformers.core_model_loading import apply_converters  # lazy: see _conversions

    return apply_converters(key, converters)


def renamed_key(key: str, renamings: list) -> str:
    from transformers.core_model_loading import apply_renamings  # lazy: see _conversions

    return apply_renamings(key, renamings)
