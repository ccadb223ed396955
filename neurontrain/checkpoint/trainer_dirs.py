"""Where `checkpoint migrate --to neuron` puts the rank files, per `--layout` (the facts: docs/neuron-contracts.md):

  neurontrain (default)  <dst>/model/ beside checkpoint_spec.json, config.json, done
  nxd                    <dst>/<tag>/model/ beside <tag>/checkpoint and <tag>/done (each "1", as NxD's
                         save_checkpoint writes them), <tag>/checkpoint_spec.json, <tag>/config.json
  optimum-neuron         <dst>/shards/model/ (xser by default) beside shards/mp_metadata_pp_rank_<p>.json,
                         shards/checkpoint, shards/done; <dst>/config.json, <dst>/trn_config.json

`neurontrain` is what `run --init-from` and a tensor-parallel `run` load; `nxd` is NxD's `save_checkpoint(dir, tag)`
layout (its `load_checkpoint(dir)` takes the newest tag holding `done`); `optimum-neuron` is what optimum-neuron's
`save_pretrained` writes (tag `shards`), with the parameter names its models have at that TP (optimum_layout.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from neurontrain.checkpoint.formats import TensorSource
from neurontrain.checkpoint.mapped import save_and_free
from neurontrain.checkpoint.nxd import NxdReader
from neurontrain.checkpoint.optimum_neuron import SHARDS, OptimumNeuronReader
from neurontrain.checkpoint.xser import save_xser
from neurontrain.parallel.nxd_layout import MODEL_DIR, OPTIM_DIR, SPEC_FILE, rank_file
from neurontrain.parallel.optimum_layout import (
    METADATA_FILE,
    TRN_CONFIG_FILE,
    check_expressible,
    optimum_name,
    stage_metadata,
    trn_config,
)
from neurontrain.parallel.rules import ShardingSpec, neuron_name, rule_for, stage_of

LAYOUTS = ("neurontrain", "nxd", "optimum-neuron")
DEFAULT_TAG = "migrated"
MARKER = "1"  # what NxD writes into a tag's `checkpoint` and `done` files


class ShardWriter:
    """One destination's rank files, metadata and markers, in the layout asked for."""

    def __init__(
        self, out: Path, spec: ShardingSpec, source: TensorSource, layout: str, tag: str | None, xser: bool | None
    ) -> None:
        self.out, self.spec, self.source, self.layout = out, spec, source, layout
        self.optimum = layout == "optimum-neuron"
        self.relative = Path({"neurontrain": ".", "nxd": tag or DEFAULT_TAG, "optimum-neuron": SHARDS}[layout])
        self.shards = out / self.relative
        self.naming = optimum_name if self.optimum else neuron_name
        self.xser = xser if xser is not None else self.optimum  # optimum-neuron's TrainingNeuronConfig: use_xser=True
        self.files = 0
        if self.optimum:
            check_expressible(spec, {name: rule_for(spec, name) for name in spec.names})
        self.shards.mkdir(exist_ok=True)
        if layout != "neurontrain":
            (self.shards / "checkpoint").write_text(MARKER)  # NxD: marks the tag directory as a checkpoint
        (self.shards / MODEL_DIR).mkdir()

    def write_rank(self, tensors: dict, tp: int, pp: int) -> None:
        path = self.shards / MODEL_DIR / rank_file(tp, pp)
        if self.xser:
            save_xser(tensors, path)
        else:
            save_and_free(tensors, path)
        self.files += 1

    def optim_file(self, tp: int, pp: int) -> Path:
        (self.shards / OPTIM_DIR).mkdir(exist_ok=True)
        return self.shards / OPTIM_DIR / rank_file(tp, pp)

    def finish(self, config: dict | None) -> None:
        """The metadata beside the rank files: optimum-neuron's per-stage metadata, or the sharding spec."""
        if self.optimum:
            shapes = {name: self.source.meta(name)[0] for name in self.spec.names}
            for pp in range(self.spec.pp):
                names = [n for n in self.spec.names if stage_of(self.spec, n) == pp]
                metadata = stage_metadata(self.spec, names, shapes)
                (self.shards / METADATA_FILE.format(pp)).write_text(json.dumps(metadata, indent=4))
            (self.out / TRN_CONFIG_FILE).write_text(json.dumps(trn_config(self.spec, self.xser), indent=4))
        else:
            (self.shards / SPEC_FILE).write_text(json.dumps(self.spec.to_json(), indent=1))
        if config is not None:
            home = self.out if self.optimum else self.shards
            (home / "config.json").write_text(json.dumps(config, indent=2))

    def reader(self) -> NxdReader | OptimumNeuronReader:
        return OptimumNeuronReader(self.shards) if self.optimum else NxdReader(self.shards)

    def mark_done(self) -> None:
        (self.shards / "done").write_text(MARKER)
