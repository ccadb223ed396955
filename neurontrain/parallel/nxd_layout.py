"""One tensor-parallel rank's tensors in the NxD (Neuron) checkpoint layout, as pure functions: the file names,
which Hugging Face tensors a Neuron tensor fuses (q, k, v into `qkv_proj.weight_q/_k/_v` or `weight_qkv`; gate
and up into `gate_up_proj.weight`), and the rank's pieces fused and split again. `checkpoint migrate` writes
this layout from whole tensors; tensor-parallel training writes and reads it from each rank's own pieces.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from neurontrain.parallel.rules import (
    PACKED,
    ShardingSpec,
    neuron_name,
    refuse_vocab_rows,
    rule_for,
    split_dim,
    split_fused,
)

Naming = Callable[[ShardingSpec, str, str], str]  # (spec, hf name, rule) -> the tensor's name in a rank file

MODEL_DIR, OPTIM_DIR = "model", "optim"
SPEC_FILE = "checkpoint_spec.json"  # the ShardingSpec, beside the rank files
_FUSION_ORDER = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}


def rank_file(tp: int, pp: int) -> str:
    return f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def fused_groups(
    spec: ShardingSpec, names: list[str], naming: Naming = neuron_name
) -> dict[str, list[tuple[str, str]]]:
    """neuron name -> [(hf name, rule)] in fusion order (q, k, v / gate, up); `naming` names the tensors (NxD's
    GQAQKVColumnParallelLinear names by default; optimum_layout.optimum_name for optimum-neuron's models)."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for name in names:
        rule = rule_for(spec, name)
        groups.setdefault(naming(spec, name, rule), []).append((name, rule))
    for members in groups.values():
        members.sort(key=lambda m: _FUSION_ORDER.get(m[1], 0))
    return groups


def fuse_rank(
    spec: ShardingSpec,
    names: list[str],
    piece: Callable[[str, str], torch.Tensor],
    naming: Naming = neuron_name,
) -> dict[str, torch.Tensor]:
    """One rank's {neuron name: tensor}: `piece(hf name, rule)` is the rank's piece of each tensor in `names`;
    the members of a fused group are concatenated on dim 0."""
    out = {}
    for target, members in fused_groups(spec, names, naming).items():
        parts = [piece(name, rule) for name, rule in members]
        out[target] = owned(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
    return out


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor if it is contiguous and alone in its storage, else a contiguous copy: torch.save writes a
    view's whole storage, and a piece must not share memory with the tensor it was cut from."""
    storage = tensor.untyped_storage()
    alone = tensor.storage_offset() == 0 and storage.nbytes() == tensor.numel() * tensor.element_size()
    return tensor if alone and tensor.is_contiguous() else tensor.clone(memory_format=torch.contiguous_format)


def unfuse_rank(spec: ShardingSpec, names: list[str], fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `fuse_rank`: one rank's piece of each tensor in `names` from its file's {neuron name: tensor}.
    KeyError names a Neuron tensor the file lacks."""
    out = {}
    for target, members in fused_groups(spec, names).items():
        tensor = fused[target]
        for name, rule in members:
            if len(members) == 1:
                out[name] = tensor
            else:
                out[name] = split_fused(spec, "qkv" if rule in ("q", "k", "v") else "gate_up", tensor)[rule]
    return out


MOMENTS = ("exp_avg", "exp_avg_sq")


def fuse_moments(
    spec: ShardingSpec,
    names: list[str],
    moment: Callable[[str, str, str], torch.Tensor],
    step: Callable[[str], torch.Tensor],
) -> dict[str, dict[str, torch.Tensor]]:
    """One rank's AdamW state in the layout of `optim/` files: {neuron name: {"exp_avg", "exp_avg_sq", "step"}},
    `moment(hf name, rule, moment name)` the rank's piece of a moment, `step(hf name)` its step count (a fused
    group takes its first member's)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for kind in MOMENTS:
        pieces = fuse_rank(spec, names, lambda name, rule, kind=kind: moment(name, rule, kind))
        for target, tensor in pieces.items():
            out.setdefault(target, {})[kind] = tensor
    for target, members in fused_groups(spec, names).items():
        out[target]["step"] = step(members[0][0])
    return out


def unfuse_moments(
    spec: ShardingSpec, names: list[str], fused: dict[str, dict[str, torch.Tensor]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Inverse of `fuse_moments`: {hf name: {"exp_avg", "exp_avg_sq", "step"}} of one rank."""
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    for kind in MOMENTS:
        for name, tensor in unfuse_rank(spec, names, {t: state[kind] for t, state in fused.items()}).items():
            out[name][kind] = tensor
    for target, members in fused_groups(spec, names).items():
        for name, _ in members:  # a copy each: AdamW increments a tensor step in place, once per parameter
            out[name]["step"] = torch.as_tensor(fused[target]["step"]).clone()
    return out


def merged_shape(spec: ShardingSpec, rule: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape `merge` gives pieces of these shapes, by arithmetic (meta-device ops import TorchDynamo)."""
    out, dim = list(shapes[0]), 0 if rule == "vocab" else split_dim(rule, len(shapes[0]))
    heads = spec.num_heads + (2 * spec.num_kv_heads if rule in PACKED else 0)
    if rule == "gate_up_packed":
        out[dim] *= spec.tp
    elif rule in PACKED or rule in ("q", "o"):
        out[dim] = heads * spec.head_dim
    elif rule in ("vocab", "column", "gate", "up", "row", "k", "v", "conv1d_column", "conv1d_row"):
        kept = shapes[: spec.num_kv_heads] if rule in ("k", "v") and spec.tp > spec.num_kv_heads else shapes
        out[dim] = sum(shape[dim] for shape in kept)
        if rule == "vocab" and spec.vocab_padding:
            out[0] = spec.vocab_size if out[0] == spec.vocab_rows else refuse_vocab_rows(spec, out[0])
    elif rule != "replicate":
        raise ValueError(rule)
    return tuple(out)
