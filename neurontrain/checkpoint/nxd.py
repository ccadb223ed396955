"""The Neuron (NxD) per-rank checkpoint layout: writing shards from a full checkpoint, and reading them back
as full tensors.

  <dir>/model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt   flat {name: tensor}, torch.save (older layout:
                                                    <dir>/tp_rank_TT_pp_rank_PP/checkpoint.pt; xser form:
                                                    the file plus <file>.tensors/tensor_<i>.pt)
  <dir>/optim/dp_rank_00_tp_rank_TT_pp_rank_PP.pt   {name: {"exp_avg", "exp_avg_sq", "step"}} (--with-optimizer)
  <dir>/checkpoint_spec.json                        the ShardingSpec: the reverse direction needs no model code
                                                    (vocab_size and padded_vocab_size: the rows of vocab-split
                                                    shards beyond vocab_size are padding)
  <dir>/config.json                                 the Hugging Face config, when known
  <dir>/done                                        written last
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from neurontrain.checkpoint.formats import load_torch_file
from neurontrain.errors import UsageError
from neurontrain.parallel.nxd_layout import SPEC_FILE, fuse_rank, fused_groups
from neurontrain.parallel.rules import ShardingSpec, merge, rule_for, shard, split_fused, stage_of

_FILE = re.compile(r"dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
_OLD_DIR = re.compile(r"tp_rank_(\d+)_pp_rank_(\d+)$")


def is_nxd_checkpoint(path: Path) -> bool:
    return path.is_dir() and (
        any((path / "model").glob("dp_rank_*_tp_rank_*_pp_rank_*.pt"))
        or any(p.is_dir() and _OLD_DIR.match(p.name) for p in path.iterdir())
    )


def rank_tensors(
    spec: ShardingSpec,
    get: Callable[[str], torch.Tensor],
    names: list[str],
    tp: int,
    cast: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """One rank's {neuron name: shard} for the given HF names (all on this rank's stage)."""
    return fuse_rank(spec, names, lambda name, rule: shard(spec, rule, cast(get(name)), tp))


def stage_names(spec: ShardingSpec, pp: int) -> list[str]:
    return [n for n in spec.names if stage_of(spec, n) == pp]


class NxdReader:
    """Full tensors under HF names from a per-rank checkpoint; one stage's files are open at a time."""

    def __init__(self, directory: Path, spec: ShardingSpec | None = None) -> None:
        self.directory = directory
        spec_path = directory / SPEC_FILE
        if spec is None:
            if not spec_path.is_file():
                raise UsageError(
                    f"{directory}: no {SPEC_FILE} beside the shards (written by `neurontrain checkpoint "
                    "migrate --to neuron`); cannot tell how the tensors were split"
                )
            try:
                spec = ShardingSpec.from_json(json.loads(spec_path.read_text()))
            except (json.JSONDecodeError, TypeError) as exc:
                raise UsageError(f"{spec_path} is not a valid sharding spec ({type(exc).__name__})") from None
        self.spec = spec
        self.files = self._find_files()
        found_tp = 1 + max(t for t, _ in self.files)
        found_pp = 1 + max(p for _, p in self.files)
        if (found_tp, found_pp) != (spec.tp, spec.pp) or len(self.files) != spec.tp * spec.pp:
            raise UsageError(
                f"{directory}: {len(self.files)} shard files for tp {found_tp} x pp {found_pp}, but the "
                f"spec says tp {spec.tp} x pp {spec.pp}"
            )
        self._stage: int | None = None
        self._open: dict[int, dict] = {}
        config = directory / "config.json"
        self.config = json.loads(config.read_text()) if config.is_file() else None
        self.description = f"NxD tp {spec.tp} pp {spec.pp} {directory}"
        self.layout, self.writer = "nxd", "neurontrain checkpoint migrate --to neuron (NxD per-rank shards)"
        self._groups = fused_groups(spec, spec.names)
        self._target = {name: target for target, members in self._groups.items() for name, _ in members}

    def _find_files(self) -> dict[tuple[int, int], Path]:
        files = {}
        for p in (self.directory / "model").glob("*.pt"):
            m = _FILE.search(p.name)
            if m:
                files[(int(m.group(2)), int(m.group(3)))] = p
        if not files:
            for d in self.directory.iterdir():
                m = _OLD_DIR.match(d.name)
                if d.is_dir() and m and (d / "checkpoint.pt").is_file():
                    files[(int(m.group(1)), int(m.group(2)))] = d / "checkpoint.pt"
        if not files:
            raise UsageError(f"{self.directory}: no per-rank shard files (model/dp_rank_*_tp_rank_*_pp_rank_*.pt)")
        return files

    def _load_stage(self, stage: int) -> None:
        if self._stage != stage:
            self._open = {tp: _load_rank_file(self.files[(tp, stage)]) for tp in range(self.spec.tp)}
            self._stage = stage

    def keys(self) -> list[str]:
        return list(self.spec.names)

    def rank_file_tensors(self, tp: int, pp: int) -> dict[str, torch.Tensor]:
        """One rank file's {neuron name: tensor}, as written (no merging)."""
        return _load_rank_file(self.files[(tp, pp)])

    def get(self, name: str) -> torch.Tensor:
        spec = self.spec
        stage = stage_of(spec, name)
        self._load_stage(stage)
        target = self._target[name]
        rule = rule_for(spec, name)
        pieces = []
        for tp in range(spec.tp):
            try:
                piece = self._open[tp][target]
            except KeyError:
                raise UsageError(f"{self.files[(tp, stage)]} lacks {target}") from None
            if len(self._groups[target]) > 1:
                piece = split_fused(spec, "qkv" if rule in ("q", "k", "v") else "gate_up", piece)[rule]
            pieces.append(piece)
        return merge(spec, rule, pieces)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        tensor = self.get(name)
        return tuple(tensor.shape), tensor.dtype

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        optim = self.directory / "optim"
        if not optim.is_dir():
            return None
        out: dict[str, dict[str, torch.Tensor]] = {}
        spec = self.spec
        per_file = {key: _load_rank_file(optim / path.name) for key, path in self.files.items()}
        for name in spec.names:
            stage, rule, target = stage_of(spec, name), rule_for(spec, name), self._target[name]
            state: dict[str, torch.Tensor] = {}
            for moment in ("exp_avg", "exp_avg_sq"):
                pieces = []
                for tp in range(spec.tp):
                    piece = per_file[(tp, stage)][target][moment]
                    if len(self._groups[target]) > 1:
                        piece = split_fused(spec, "qkv" if rule in ("q", "k", "v") else "gate_up", piece)[rule]
                    pieces.append(piece)
                state[moment] = merge(spec, rule, pieces)
            # a copy for each member of a fused group: AdamW adds to a tensor step in place, once per parameter
            state["step"] = torch.as_tensor(per_file[(0, stage)][target]["step"]).clone()
            out[name] = state
        return out


def _load_rank_file(path: Path) -> dict:
    if (path.parent / (path.name + ".tensors")).is_dir():
        import torch_xla.utils.serialization as xser  # lazy: torch_xla only for xser-format shards

        try:
            data = xser.load(str(path))
        except Exception as exc:
            raise UsageError(f"{path} is not a readable xser checkpoint ({type(exc).__name__})") from None
    else:
        data = load_torch_file(path)
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
    if not isinstance(data, dict):
        raise UsageError(f"{path} does not hold a mapping of tensor names")
    return data
