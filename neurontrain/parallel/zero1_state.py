"""ZeRO-1 optimizer state in torch-xla's `ZeroRedundancyOptimizer` format, and its conversions.

One data-parallel rank's state dict, as `ZeroRedundancyOptimizer.state_dict()` returns it with
save_master_weights=True (NxD's `NeuronZero1Optimizer` saves the same dict per rank, adding dp_rank/tp_rank):

- ``state``: ``{}`` (the wrapper keeps no state of its own)
- ``param_groups``: the hyper-parameters, ``params`` numbering the parameters in group order
- ``base_state``: ``{i: {step, exp_avg, exp_avg_sq}}``: AdamW's state of parameter i's chunk
- ``shape_info``: ``{i: torch.Size}``: parameter i's full shape
- ``sharded_master_weights``: ``{i: chunk}``: the fp32 master copy of the chunk

Chunks follow `zero_layout` (padded on dim 0 to a multiple of the world size, chunk r to rank r).
`consolidate` turns the rank dicts of one world into a plain AdamW state dict (what a replicated run keeps)
and the full master weights; `rank_state` cuts a plain state dict for one rank of any world. Together they
resume a run at another world size. `numbered_state` makes a plain state dict from moments keyed by parameter
name (a converted checkpoint's, for `run --init-from`). Plain functions on CPU tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch

from neurontrain.parallel.zero_layout import real_rows, shard_shape


def chunk(tensor: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s chunk of `tensor` (a new tensor; rows past the end of dim 0 are zeros)."""
    out = tensor.new_zeros(shard_shape(tensor.shape, world))
    rows = real_rows(tensor.shape[0], world, rank)
    out[: len(rows)] = tensor[rows.start : rows.stop]
    return out


def unchunk(chunks: Sequence[torch.Tensor], dim0: int) -> torch.Tensor:
    """The parameter-shaped tensor that `chunks` (rank order, one world) hold, padding dropped."""
    return torch.cat(list(chunks))[:dim0]


MOMENTS = ("exp_avg", "exp_avg_sq")


def numbered_state(
    named: Mapping[str, Mapping[str, torch.Tensor]],
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    param_groups: Sequence[dict],
) -> dict:
    """A plain AdamW state dict from AdamW state keyed by parameter name: entry i is parameter names[i], of
    shape shapes[i] (the numbering of the optimizer that will load it), with both moments and its step count
    (a float32 scalar, 0 when absent). param_groups are the loading optimizer's own, so its hyper-parameters
    stay. A ValueError names the first parameter without both moments, or with moments of another shape."""
    if len(names) != len(shapes):
        raise ValueError(f"{len(names)} names but {len(shapes)} shapes")
    missing = [n for n in names if not all(m in named.get(n, {}) for m in MOMENTS)]
    if missing:
        raise ValueError(f"no AdamW moments for {len(missing)} of the {len(names)} parameters (first: {missing[0]})")
    state = {}
    for i, (name, shape) in enumerate(zip(names, shapes)):
        entry = named[name]
        for moment in MOMENTS:
            if tuple(entry[moment].shape) != tuple(shape):
                raise ValueError(f"{name}: {moment} is {list(entry[moment].shape)}, the parameter {list(shape)}")
        step = torch.tensor(float(entry.get("step", 0.0)), dtype=torch.float32)
        state[i] = {"step": step, **{moment: entry[moment] for moment in MOMENTS}}
    return {"state": state, "param_groups": copy.deepcopy(list(param_groups))}


def _is_chunked(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0  # AdamW's "step" is a scalar, the same on every rank


def rank_state(
    plain: dict, shapes: Sequence[Sequence[int]], masters: Sequence[torch.Tensor], world: int, rank: int
) -> dict:
    """One rank's ZeRO-1 state dict from a plain AdamW state dict (torch.optim format, parameters numbered in
    group order), the parameters' shapes and their fp32 master values, in that numbering."""
    if len(shapes) != len(masters):
        raise ValueError(f"{len(shapes)} shapes but {len(masters)} master weights")
    base_state = {
        int(i): {k: chunk(v, world, rank) if _is_chunked(v) else copy.deepcopy(v) for k, v in state.items()}
        for i, state in plain["state"].items()
    }
    return {
        "state": {},
        "param_groups": copy.deepcopy(plain["param_groups"]),
        "base_state": base_state,
        "shape_info": {i: torch.Size(s) for i, s in enumerate(shapes)},
        "sharded_master_weights": {i: chunk(m.to(torch.float32), world, rank) for i, m in enumerate(masters)},
        "dp_rank": rank,
        "tp_rank": 0,
    }


def consolidate(ranks: Sequence[dict]) -> tuple[dict, list[torch.Tensor]]:
    """(plain AdamW state dict, full fp32 master weights) from the state dicts of every rank of one world, in
    rank order. Checks that each chunk has the rows the layout gives it."""
    world = len(ranks)
    if world == 0:
        raise ValueError("no ZeRO-1 rank state to consolidate")
    shapes = ranks[0]["shape_info"]
    for r, state in enumerate(ranks):
        if state.get("dp_rank", r) != r or state["shape_info"] != shapes:
            raise ValueError(f"ZeRO-1 rank state {r} does not belong to the same world (rank {state.get('dp_rank')})")
        for i, master in state["sharded_master_weights"].items():
            if tuple(master.shape) != shard_shape(shapes[i], world):
                raise ValueError(
                    f"ZeRO-1 rank {r}: parameter {i}'s chunk has shape {tuple(master.shape)}, not "
                    f"{shard_shape(shapes[i], world)} (full shape {tuple(shapes[i])} over {world} ranks)"
                )
    plain_state = {}
    for i, first in ranks[0]["base_state"].items():
        dim0 = shapes[i][0]
        plain_state[i] = {
            k: unchunk([r["base_state"][i][k] for r in ranks], dim0) if _is_chunked(v) else copy.deepcopy(v)
            for k, v in first.items()
        }
    masters = [unchunk([r["sharded_master_weights"][i] for r in ranks], shapes[i][0]) for i in sorted(shapes)]
    return {"state": plain_state, "param_groups": copy.deepcopy(ranks[0]["param_groups"])}, masters


def state_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes the tensors hold (their elements, not their allocations)."""
    return sum(t.numel() * t.element_size() for t in tensors)
