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
  <dir>/done                                        written last ("1", as NxD writes it)

NxD's own `save_checkpoint(dir, tag)` puts these under a tag directory, <dir>/<tag>/, beside a `checkpoint` file;
pointed at <dir>, the newest tag holding `done` is read, as NxD's `load_checkpoint(dir)` picks it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from neurontrain.checkpoint.formats import TensorSource, load_torch_file, read_piece
from neurontrain.checkpoint.mapped import MappedFiles, narrowed, nbytes
from neurontrain.checkpoint.xser import XserFile, is_xser
from neurontrain.errors import UsageError
from neurontrain.logs import get_logger
from neurontrain.parallel.nxd_layout import (
    MOMENTS,
    SPEC_FILE,
    Naming,
    fuse_rank,
    fused_groups,
    merged_shape,
    unfuse_moments,
)
from neurontrain.parallel.rules import (
    ShardingSpec,
    merge,
    neuron_name,
    piece_of,
    rule_for,
    split_fused,
    stage_of,
)

log = get_logger(__name__)

_FILE = re.compile(r"dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
_OLD_DIR = re.compile(r"tp_rank_(\d+)_pp_rank_(\d+)$")


def _holds_shards(path: Path) -> bool:
    return path.is_dir() and (
        any((path / "model").glob("dp_rank_*_tp_rank_*_pp_rank_*.pt"))
        or any(p.is_dir() and _OLD_DIR.match(p.name) for p in path.iterdir())
    )


def newest_tag(path: Path) -> Path | None:
    """The newest complete NxD tag directory under `path` (a subdirectory holding `done`, by the time it was
    written, as NxD's `list_completed_checkpoint_tags` orders them), or None."""
    if not path.is_dir():
        return None
    tags = [d for d in path.iterdir() if (d / "done").is_file() and _holds_shards(d)]
    return max(tags, key=lambda d: ((d / "done").stat().st_mtime, d.name)) if tags else None


def incomplete_tags(path: Path) -> list[str]:
    """NxD tag directories under `path` marked `checkpoint` but without `done` (a save that did not finish)."""
    if not path.is_dir():
        return []
    return sorted(d.name for d in path.iterdir() if (d / "checkpoint").is_file() and not (d / "done").is_file())


def shards_directory(path: Path) -> Path | None:
    """The directory holding model/ of an NxD checkpoint at `path` (itself or its newest complete tag), or None."""
    return path if _holds_shards(path) else newest_tag(path)


def is_nxd_checkpoint(path: Path) -> bool:
    """NxD rank files with neurontrain's spec or none; not optimum-neuron's (its metadata beside them:
    optimum_neuron.py reads those)."""
    found = shards_directory(path)
    return found is not None and not any(found.glob("mp_metadata_pp_rank_*"))


def rank_tensors(
    spec: ShardingSpec,
    source: TensorSource,
    names: list[str],
    tp: int,
    cast: Callable[[torch.Tensor], torch.Tensor],
    naming: Naming = neuron_name,
) -> dict[str, torch.Tensor]:
    """One rank's {neuron name: shard} for the given HF names (all on this rank's stage), each read by slice."""

    def piece(name: str, rule: str) -> torch.Tensor:
        return cast(read_piece(source, name, piece_of(spec, rule, source.meta(name)[0], tp)))

    return fuse_rank(spec, names, piece, naming)


def stage_names(spec: ShardingSpec, pp: int) -> list[str]:
    return [n for n in spec.names if stage_of(spec, n) == pp]


class NxdReader:
    """Full tensors under HF names from a per-rank checkpoint; one stage's files are open at a time."""

    def __init__(self, directory: Path, spec: ShardingSpec | None = None) -> None:
        directory = shards_directory(directory) or directory
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
        self._mapped = MappedFiles(load_rank_file)
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

    def keys(self) -> list[str]:
        return list(self.spec.names)

    def rank_file_tensors(self, tp: int, pp: int) -> dict[str, torch.Tensor]:
        """One rank file's {neuron name: tensor}, as written (no merging)."""
        return load_rank_file(self.files[(tp, pp)])

    def _pieces(self, name: str) -> list[torch.Tensor]:
        stage, rule, target = stage_of(self.spec, name), rule_for(self.spec, name), self._target[name]
        pieces = []
        for tp in range(self.spec.tp):
            path = self.files[(tp, stage)]
            try:
                piece = self._mapped[path][target]
            except KeyError:
                raise UsageError(f"{path} lacks {target}") from None
            if len(self._groups[target]) > 1:
                piece = split_fused(self.spec, "qkv" if rule in ("q", "k", "v") else "gate_up", piece)[rule]
            pieces.append(piece)
        return pieces

    def get(self, name: str) -> torch.Tensor:
        tensor = merge(self.spec, rule_for(self.spec, name), self._pieces(name))
        self._mapped.read(nbytes(tensor))
        return tensor

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return narrowed(self.get(name), dim, start, stop)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The merged tensor's shape and dtype, from the pieces' (no tensor data is read)."""
        pieces = self._pieces(name)
        return merged_shape(self.spec, rule_for(self.spec, name), [tuple(p.shape) for p in pieces]), pieces[0].dtype

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """AdamW state under HF names, read one rank file at a time: each file's pieces are copied out before the
        next is mapped, and every tensor is merged once all its pieces are read."""
        optim = self.directory / "optim"
        if not optim.is_dir():
            return None
        spec = self.spec
        out: dict[str, dict[str, torch.Tensor]] = {}
        for stage in range(spec.pp):
            names = stage_names(spec, stage)
            pieces: dict[str, list[dict[str, torch.Tensor]]] = {name: [] for name in names}
            for tp in range(spec.tp):
                path = optim / self.files[(tp, stage)].name
                try:
                    rank = unfuse_moments(spec, names, load_rank_file(path))
                except KeyError as exc:
                    raise UsageError(f"{path} lacks the optimizer state of {exc.args[0]}") from None
                for name in names:
                    pieces[name].append({k: v.clone() for k, v in rank[name].items()})
                del rank
            for name in names:
                ranks, rule = pieces.pop(name), rule_for(spec, name)
                out[name] = {kind: merge(spec, rule, [r[kind] for r in ranks]) for kind in MOMENTS}
                out[name]["step"] = ranks[0]["step"]
        return out


def load_rank_file(path: Path) -> dict:
    """A rank file's {name: tensor}: memory-mapped, or in xser form each tensor loaded when first asked for."""
    data = XserFile(path) if is_xser(path) else load_torch_file(path)
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
    if not hasattr(data, "keys"):
        raise UsageError(f"{path} does not hold a mapping of tensor names")
    return data
