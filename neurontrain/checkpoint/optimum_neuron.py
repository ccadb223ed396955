"""optimum-neuron's sharded checkpoints, read as full Hugging Face tensors from its own metadata.

optimum-neuron's `save_pretrained` (and its Trainer's checkpoints) lay a model out as NxD's `save_checkpoint`
with the tag `shards`:

  <dir>/config.json, trn_config.json
  <dir>/shards/model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt   (+ .pt.tensors/ and .pt.info.pt with use_xser, its
                                                           default)
  <dir>/shards/mp_metadata_pp_rank_<p>.json                parameters' tensor-parallel attributes and the
                                                           modules' weight transformation specs
  <dir>/shards/checkpoint, <dir>/shards/done               NxD's markers, each holding "1"

Each Hugging Face tensor is rebuilt as optimum-neuron's consolidation rebuilds it (FusedLinearsSpec: each rank's
piece split by original size / TP, concatenated on the partition dim; GQAQKVColumnParallelLinearSpec: query and
output heads put back in Hugging Face's order, the first copy of each KV head kept; any other parallel parameter
concatenated on its partition dim; the rest taken from rank 0), reading only the pieces it needs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from neurontrain.checkpoint.mapped import MappedFiles, narrowed, nbytes
from neurontrain.checkpoint.nxd import load_rank_file
from neurontrain.checkpoint.xser import is_xser
from neurontrain.errors import UsageError
from neurontrain.parallel.optimum_layout import FUSED_SPEC, GQA_SPEC, METADATA_FILE
from neurontrain.parallel.rules import ShardingSpec, merge

SHARDS = "shards"
_FILE = re.compile(r"dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")

Recipe = Callable[[Callable[[str, int], torch.Tensor]], torch.Tensor]  # piece(name, tp rank) -> full tensor


def shards_of(path: Path) -> Path | None:
    """The `shards` directory of an optimum-neuron checkpoint (the directory itself or its shards/), or None."""
    for candidate in (path / SHARDS, path):
        if (candidate / METADATA_FILE.format(0)).is_file() or (candidate / "mp_metadata_pp_rank_0.pt").is_file():
            return candidate
    return None


def _metadata(shards: Path, pp: int) -> dict:
    json_path = shards / METADATA_FILE.format(pp)
    try:
        if json_path.is_file():
            return json.loads(json_path.read_text())
        return torch.load(shards / f"mp_metadata_pp_rank_{pp}.pt", weights_only=True)
    except (OSError, json.JSONDecodeError, RuntimeError) as exc:
        raise UsageError(f"{shards}: pipeline stage {pp}'s metadata is unreadable ({type(exc).__name__})") from None


def _gqa_spec(fields: dict, pieces_tp: int) -> ShardingSpec:
    heads, kv, tp = fields["num_attention_heads"], fields["num_key_value_heads"], fields["tp_size"]
    spec = ShardingSpec(
        family="", tp=tp, pp=1, num_layers=0, num_heads=heads, num_kv_heads=kv, vocab_size=0, rules=[],
        head_dim=fields["q_output_size_per_partition"] * tp // heads,
    )  # fmt: skip
    if tp != pieces_tp or fields["kv_size_multiplier"] != spec.kv_multiplier:
        raise UsageError(
            f"a GQA attention of {heads} query / {kv} KV heads at TP {tp} with kv_size_multiplier "
            f"{fields['kv_size_multiplier']} (read: TP {pieces_tp}, multiplier TP // KV = {spec.kv_multiplier})"
        )
    return spec


def _gqa_recipes(module: str, fields: dict, tp: int) -> tuple[dict[str, Recipe], set[str]]:
    spec, recipes, consumed = _gqa_spec(fields, tp), {}, set()
    q_rows, kv_rows = fields["q_output_size_per_partition"], fields["kv_output_size_per_partition"]
    sections = {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}
    proj = {r: fields[f"{n}_projection_name"] for r, n in (("q", "query"), ("k", "key"), ("v", "value"))}
    qkv = f"{module}.{fields['gqa_qkv_projection_name']}"
    for param in ("weight", "bias") if fields["bias"] else ("weight",):
        consumed |= {f"{qkv}.{param}_qkv"} if fields["fuse_qkv"] else {f"{qkv}.{param}_{r}" for r in sections}
        for rule, (start, rows) in sections.items():

            def recipe(piece, rule=rule, start=start, rows=rows, param=param):
                if fields["fuse_qkv"]:
                    parts = [piece(f"{qkv}.{param}_qkv", r).narrow(0, start, rows) for r in range(tp)]
                else:
                    parts = [piece(f"{qkv}.{param}_{rule}", r) for r in range(tp)]
                return merge(spec, rule, parts)

            recipes[f"{module}.{proj[rule]}.{param}"] = recipe
        out = f"{module}.{fields['output_projection_name']}.{param}"
        recipes[out] = lambda piece, out=out: merge(spec, "o", [piece(out, r) for r in range(tp)])
    return recipes, consumed


def _fused_recipes(module: str, fields: dict, parameters: dict, tp: int) -> tuple[dict[str, Recipe], set[str]]:
    recipes, consumed = {}, set()
    sizes = [dim // fields["tp_size"] for dim in fields["original_dims"]]
    axis = {"column": 0, "row": 1}.get(fields["fuse_axis"], fields["fuse_axis"])
    for param in ("weight", "bias") if fields["bias"] else ("weight",):
        fused = f"{module}.{fields['fused_linear_name']}.{param}"
        dim = parameters.get(fused, {}).get("partition_dim", 0)
        consumed.add(fused)
        for index, linear in enumerate(fields["linear_names"]):

            def recipe(piece, fused=fused, index=index, dim=dim):
                parts = [torch.split(piece(fused, r), sizes, dim=axis)[index] for r in range(tp)]
                return torch.cat(parts, dim=dim)

            recipes[f"{module}.{linear}.{param}"] = recipe
    return recipes, consumed


def stage_recipes(metadata: dict, tp: int) -> tuple[dict[str, Recipe], set[str]]:
    """{hf name: how to rebuild it from the rank pieces} of one stage, and the rank-file names they consume."""
    parameters, recipes, consumed = metadata.get("parameters", {}), {}, set()
    for entry in metadata.get("model_weight_transformation_specs", []):
        module = entry["module_fully_qualified_name"]
        for cls_name, fields in entry["specs"]:
            if fields.get("peft_type"):
                raise UsageError(f"{module}: adapter (PEFT {fields['peft_type']}) checkpoints are not read")
            if cls_name == GQA_SPEC:
                made, used = _gqa_recipes(module, fields, tp)
            elif cls_name == FUSED_SPEC:
                made, used = _fused_recipes(module, fields, parameters, tp)
            else:
                raise UsageError(f"{module}: optimum-neuron transformation {cls_name} is not known here")
            recipes, consumed = recipes | made, consumed | used
    for name, attributes in parameters.items():
        if name in recipes or name in consumed:
            continue
        if attributes.get("tensor_model_parallel"):
            dim = attributes["partition_dim"]
            recipes[name] = lambda piece, name=name, dim=dim: torch.cat([piece(name, r) for r in range(tp)], dim=dim)
        else:
            recipes[name] = lambda piece, name=name: piece(name, 0)
    return recipes, consumed


class OptimumNeuronReader:
    """Full tensors under Hugging Face names from an optimum-neuron `shards/` directory."""

    def __init__(self, shards: Path) -> None:
        self.directory = shards
        self.files = self._find_files(shards / "model")
        self.tp = 1 + max(t for t, _ in self.files)
        self.pp = 1 + max(p for _, p in self.files)
        if len(self.files) != self.tp * self.pp:
            raise UsageError(f"{shards}/model: {len(self.files)} shard files for tp {self.tp} x pp {self.pp}")
        self._recipes: dict[str, tuple[int, Recipe]] = {}
        for pp in range(self.pp):
            recipes, _ = stage_recipes(_metadata(shards, pp), self.tp)
            self._recipes |= {name: (pp, recipe) for name, recipe in recipes.items()}
        self._mapped = MappedFiles(load_rank_file)
        config = shards.parent / "config.json"
        self.config = json.loads(config.read_text()) if config.is_file() else None
        xser = any(is_xser(p) for p in self.files.values())
        self.description = f"optimum-neuron tp {self.tp} pp {self.pp} {shards.parent}"
        self.layout = "optimum-neuron"
        self.writer = "optimum-neuron's save_pretrained layout (NxD save_checkpoint, tag shards" + (
            ", xser)" if xser else ")"
        )

    @staticmethod
    def _find_files(model: Path) -> dict[tuple[int, int], Path]:
        files = {}
        for path in model.glob("dp_rank_*.pt"):
            m = _FILE.search(path.name)
            if m and int(m.group(1)) == 0:
                files[(int(m.group(2)), int(m.group(3)))] = path
        if not files:
            raise UsageError(f"{model}: no per-rank shard files (dp_rank_00_tp_rank_*_pp_rank_*.pt)")
        return files

    def keys(self) -> list[str]:
        return list(self._recipes)

    def _piece_reader(self, pp: int, meta: bool) -> Callable[[str, int], torch.Tensor]:
        def piece(name: str, tp: int) -> torch.Tensor:
            path = self.files[(tp, pp)]
            try:
                tensor = self._mapped[path][name]
            except KeyError:
                raise UsageError(f"{path} lacks {name}, which its metadata lists") from None
            return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta") if meta else tensor

        return piece

    def get(self, name: str) -> torch.Tensor:
        pp, recipe = self._recipes[name]
        tensor = recipe(self._piece_reader(pp, meta=False))
        self._mapped.read(nbytes(tensor))
        return tensor.contiguous()

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return narrowed(self.get(name), dim, start, stop)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        pp, recipe = self._recipes[name]
        tensor = recipe(self._piece_reader(pp, meta=True))
        return tuple(tensor.shape), tensor.dtype

    def optimizer_state(self) -> None:
        return None  # its optim/ files are NxD optimizer state dicts, keyed by parameter index: not read
