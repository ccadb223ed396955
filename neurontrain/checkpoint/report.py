"""`neurontrain checkpoint inspect SRC`: what a checkpoint is before anything is converted: the layout and the
tool that wrote it, the model prefix found by matching the model of its config, tensor count, bytes and dtypes,
whether optimizer state is present, and the config it needs."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from neurontrain.checkpoint.deepspeed_zero import ZeroSource
from neurontrain.checkpoint.formats import DCPSource, TensorSource
from neurontrain.checkpoint.matching import MappedSource, architecture
from neurontrain.checkpoint.nxd import NxdReader
from neurontrain.checkpoint.opening import open_checkpoint
from neurontrain.checkpoint.optimum_neuron import OptimumNeuronReader
from neurontrain.errors import UsageError, first_line


def has_optimizer(source: TensorSource) -> bool:
    if isinstance(source, DCPSource):
        return bool(source.optimizer_keys)
    if isinstance(source, (NxdReader, OptimumNeuronReader)):
        return (source.directory / "optim").is_dir()
    if isinstance(source, ZeroSource):
        return bool(source.optimizer_files)
    return getattr(source, "optimizer", None) is not None


def _tensors(source: TensorSource) -> dict:
    count, total, dtypes = 0, 0, Counter()
    for name in source.keys():
        shape, dtype = source.meta(name)
        count += 1
        total += math.prod(shape) * dtype.itemsize
        dtypes[str(dtype).removeprefix("torch.")] += 1
    return {"tensors": count, "bytes": total, "dtypes": dict(dtypes)}


def _model(source: TensorSource) -> dict:
    if isinstance(source, NxdReader):
        return {"prefix": "", "model_tensors": len(source.keys()), "sharding": source.spec.to_json() | {"names": None}}
    if isinstance(source, OptimumNeuronReader):
        model = architecture(source.config) if source.config else "from mp_metadata_pp_rank_*.json"
        sharding = {"tp": source.tp, "pp": source.pp}
        return {"architecture": model, "prefix": "", "model_tensors": len(source.keys()), "sharding": sharding}
    if source.config is None:
        firsts = Counter(k.split(".", 1)[0] for k in source.keys())
        return {
            "config_needed": "the model's Hugging Face config.json: put it beside the checkpoint or pass --config",
            "top_level_names": [name for name, _ in firsts.most_common(5)],
        }
    try:
        mapped = MappedSource(source, source.config)
    except UsageError as exc:
        return {"architecture": architecture(source.config), "mapping_error": first_line(exc, 400)}
    return {
        "architecture": architecture(source.config),
        "prefix": mapped.mapping.strip,
        "prefix_added": mapped.mapping.add,
        "model_tensors": len(mapped.keys()),
        "not_converted": len(mapped.extras),
        "not_converted_first": mapped.extras[:5],
    } | _merged(mapped)


def _merged(mapped: MappedSource) -> dict:
    """The checkpoint tensors transformers' converters merged into model tensors (Mixtral's per-expert w1/w2/w3)."""
    if not mapped.merged:
        return {}
    name, sources = next(iter(mapped.merged.items()))
    return {"merged": sum(map(len, mapped.merged.values())), "merged_first": f"{sources[0]} ... -> {name}"}


def inspect_checkpoint(path: Path, config: Path | None = None) -> dict:
    source = open_checkpoint(path, config)
    return {
        "path": str(path),
        "layout": source.layout,
        "writer": source.writer,
        **_tensors(source),
        "optimizer_state": has_optimizer(source),
        **_model(source),
    }


def describe(report: dict) -> list[str]:
    """The report as lines for a terminal."""
    dtypes = ", ".join(f"{k} x{v}" for k, v in report["dtypes"].items())
    lines = [
        f"layout: {report['layout']} (written by {report['writer']})",
        f"tensors: {report['tensors']}, {report['bytes'] / 2**20:.1f} MiB, {dtypes}",
        f"optimizer state: {'present' if report['optimizer_state'] else 'none'}",
    ]
    if "config_needed" in report:
        lines.append(f"config needed: {report['config_needed']} (top-level names: {report['top_level_names']})")
    elif "mapping_error" in report:
        lines.append(f"model {report['architecture']}: {report['mapping_error']}")
    else:
        lines.append(
            f"model {report.get('architecture', 'from checkpoint_spec.json')}: prefix {report['prefix']!r}, "
            f"{report['model_tensors']} model tensors, {report.get('not_converted', 0)} other entries not converted"
        )
    return lines
