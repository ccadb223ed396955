"""`neurontrain checkpoint migrate`: GPU checkpoints <-> Neuron (NxD) per-rank shards, in bounded memory.

`--to neuron` reads each rank's piece of each tensor by slice (rules.piece_of: one contiguous range per rule) and
writes the rank files one at a time: it holds one output file plus one tensor. `--to gpu` plans the output files
from the tensors' shapes (huggingface_hub's split) and builds them one at a time, reading the rank files through
mappings that are let go after a budget of bytes (mapped.py). The destination is built in a hidden sibling
directory and renamed into place when complete (staging.py). A vocabulary that TP does not divide is zero-padded
on the way to Neuron (see parallel/rules.py) and the padding is stripped on the way back; checkpoint_spec.json
records both sizes.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from tqdm import tqdm

from neurontrain.checkpoint.formats import TensorSource
from neurontrain.checkpoint.layouts import open_gpu_checkpoint
from neurontrain.checkpoint.mapped import save_and_free
from neurontrain.checkpoint.matching import MappedSource, check_loads, loaded_names
from neurontrain.checkpoint.nxd import NxdReader, rank_tensors, stage_names
from neurontrain.checkpoint.opening import open_checkpoint, open_model_checkpoint
from neurontrain.checkpoint.optimum_neuron import OptimumNeuronReader
from neurontrain.checkpoint.safetensors_writer import write_safetensors
from neurontrain.checkpoint.saved_names import saved_names
from neurontrain.checkpoint.staging import staged_destination
from neurontrain.checkpoint.trainer_dirs import LAYOUTS, ShardWriter
from neurontrain.errors import UsageError
from neurontrain.logs import get_logger
from neurontrain.parallel.nxd_layout import fuse_moments
from neurontrain.parallel.optimum_layout import training_note
from neurontrain.parallel.rules import ShardingSpec, shard, spec_from_config

log = get_logger(__name__)
__all__ = ["MigrateOptions", "migrate", "open_checkpoint", "open_model_checkpoint"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # huggingface_hub's default shard size for safetensors, "5GB"
# layouts whose tensor names are a Hugging Face folder's: `--to gpu` from them keeps the source's names
HF_LAYOUTS = ("hf", "hf-sharded", "hf-trainer", "accelerate", "safetensors")


@dataclass(kw_only=True)
class MigrateOptions:
    to: str  # neuron | gpu
    tp: int | None = None
    pp: int | None = None
    dtype: str | None = None
    fuse_qkv: bool = False
    with_optimizer: bool = False
    overwrite: bool = False
    config: Path | None = None
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    pad_vocab_multiple: int | None = None  # --to neuron: pad the vocabulary to a multiple of this and of TP
    layout: str = "neurontrain"  # --to neuron: whose directory layout and names (trainer_dirs.py)
    tag: str | None = None  # --layout nxd: the checkpoint tag directory
    xser: bool | None = None  # --layout nxd|optimum-neuron: torch-xla serialization (None: the trainer's default)

    def __post_init__(self) -> None:
        if self.to not in ("neuron", "gpu"):
            raise UsageError("--to must be neuron or gpu")
        if self.layout not in LAYOUTS:
            raise UsageError(f"--layout must be one of {', '.join(LAYOUTS)}")
        if self.to == "gpu" and (self.layout != "neurontrain" or self.tag is not None or self.xser is not None):
            raise UsageError("--layout, --tag and --xser apply to --to neuron (--to gpu reads every layout)")
        if self.tag is not None and self.layout != "nxd":
            raise UsageError("--tag applies to --layout nxd (optimum-neuron's tag is always 'shards')")
        if self.tag is not None and (not self.tag or "/" in self.tag or self.tag.startswith(".")):
            raise UsageError(f"--tag {self.tag!r}: a directory name (no '/', not starting with '.')")
        if self.xser and self.layout == "neurontrain":
            raise UsageError("--xser applies to --layout nxd or optimum-neuron (`run` loads plain torch files)")
        if self.with_optimizer and self.layout != "neurontrain":
            raise UsageError(
                f"--with-optimizer: --layout {self.layout}'s optim/ files are the trainer's optimizer state dict, "
                "keyed by its parameter order; they are not written (the weights are)"
            )
        for flag, value in (("--tp", self.tp), ("--pp", self.pp)):
            if value is not None and value < 1:
                raise UsageError(f"{flag} must be at least 1")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}")
        if self.max_shard_bytes < 1:
            raise UsageError("--max-shard-size must be at least 1 byte")
        if self.pad_vocab_multiple is not None and self.pad_vocab_multiple < 1:
            raise UsageError("--pad-vocab-to-multiple-of must be at least 1")
        if self.pad_vocab_multiple is not None and self.to != "neuron":
            raise UsageError("--pad-vocab-to-multiple-of applies to --to neuron (--to gpu strips the padding)")


def _cast(dtype: str | None):
    target = DTYPES[dtype] if dtype else None

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(target) if target is not None and t.is_floating_point() else t

    return cast


def _progress(total: int, desc: str):
    return tqdm(total=total, desc=desc, unit="file", disable=None, file=sys.stderr)


def to_neuron(source: TensorSource, dest: Path, opts: MigrateOptions) -> dict:
    names = source.keys()
    spec = spec_from_config(
        source.config, names, opts.tp or 1, opts.pp or 1, opts.fuse_qkv, opts.dtype, opts.pad_vocab_multiple
    )
    optimizer = source.optimizer_state() if opts.with_optimizer else None
    if opts.with_optimizer and optimizer is None:
        raise UsageError(f"--with-optimizer: {source.description} holds no optimizer state")
    cast = _cast(opts.dtype)
    with staged_destination(dest, opts.overwrite) as out:
        writer = ShardWriter(out, spec, source, opts.layout, opts.tag, opts.xser)
        with _progress(spec.tp * spec.pp * (2 if optimizer else 1), "migrate") as bar:
            for pp in range(spec.pp):
                stage = stage_names(spec, pp)
                for tp in range(spec.tp):
                    writer.write_rank(rank_tensors(spec, source, stage, tp, cast, writer.naming), tp, pp)
                    bar.update(1)
                    if optimizer is not None:
                        save_and_free(_optimizer_shard(spec, optimizer, stage, tp), writer.optim_file(tp, pp))
                        writer.files += 1
                        bar.update(1)
        if opts.layout == "optimum-neuron" and (note := training_note(spec.family)):
            log.warning(note)
        writer.finish(source.config)
        reader = writer.reader()
        check_loads(source.config, {n: reader.meta(n)[0] for n in reader.keys()}, f"the output for {dest}")
        writer.mark_done()
    return {
        "to": "neuron",
        "layout": opts.layout,
        "tp": spec.tp,
        "pp": spec.pp,
        "files": writer.files,
        "xser": writer.xser,
        "shards": str(dest / writer.relative),
        "tensors": len(names),
        "optimizer": optimizer is not None,
        "vocab_padding": _padding_report(spec, opts.pad_vocab_multiple),
        "destination": str(dest),
        **({"note": note} if opts.layout == "optimum-neuron" and (note := training_note(spec.family)) else {}),
    }


def _padding_report(spec: ShardingSpec, multiple: int | None) -> dict | None:
    if not spec.vocab_padding:
        return None
    reason = (
        f"--pad-vocab-to-multiple-of {multiple} with --tp {spec.tp}"
        if multiple
        else f"--tp {spec.tp} does not divide {spec.vocab_size} (automatic)"
    )
    return {
        "vocab_size": spec.vocab_size,
        "padded_vocab_size": spec.vocab_rows,
        "zero_rows": spec.vocab_padding,
        "reason": reason,
    }


def _optimizer_shard(spec: ShardingSpec, optimizer: dict, names: list[str], tp: int) -> dict:
    missing = [n for n in names if n not in optimizer]
    if missing:
        raise UsageError(f"optimizer state lacks parameter {missing[0]}")
    return fuse_moments(
        spec,
        names,
        lambda name, rule, kind: shard(spec, rule, optimizer[name][kind], tp),
        lambda name: torch.as_tensor(optimizer[name].get("step", 0.0)).clone(),
    )


def _written_dtype(dtype: torch.dtype, target: str | None) -> torch.dtype:
    return DTYPES[target] if target and dtype.is_floating_point else dtype


def output_names(source: TensorSource) -> dict[str, str]:
    """{name written: the source's name} for `--to gpu`: a Hugging Face folder's own names where the source is
    one, else the names the family's save_pretrained writes (GPT-NeoX: embed_out.weight), so a round trip keeps
    the original's keys and tools that read the safetensors by key (transformers 4, vLLM) find them."""
    names = source.keys()
    stored = source.stored_names() if isinstance(source, MappedSource) and source.layout in HF_LAYOUTS else None
    written = stored or (saved_names(names, source.config) if source.config is not None else {n: n for n in names})
    return {written[n]: n for n in names}


def _write_safetensors(
    source: TensorSource, names: dict[str, str], dtype: str | None, out: Path, max_shard: int
) -> int:
    """The tensors ({name written: source name}) as model.safetensors, or above max_shard bytes as Hugging Face's
    sharded files (model-0000i-of-0000n.safetensors, split by huggingface_hub's rule) with their index; each file
    is written a tensor at a time. Returns the number of files."""
    metas = {}
    for name, read in names.items():
        shape, stored = source.meta(read)
        metas[name] = shape, _written_dtype(stored, dtype)
    sizes = {name: math.prod(shape) * written.itemsize for name, (shape, written) in metas.items()}
    split = split_state_dict_into_shards_factory(
        sizes, get_storage_size=int, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard
    )
    cast = _cast(dtype)
    with tqdm(
        total=sum(sizes.values()), desc="migrate", unit="B", unit_scale=True, disable=None, file=sys.stderr
    ) as bar:

        def tensor(name: str) -> torch.Tensor:
            bar.update(sizes[name])
            return cast(source.get(names[name]))

        for filename, members in split.filename_to_tensors.items():
            write_safetensors(out / filename, {n: metas[n] for n in members}, tensor, {"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return len(split.filename_to_tensors)


def to_gpu(source: TensorSource, dest: Path, opts: MigrateOptions) -> dict:
    """Hugging Face safetensors (sharded with an index above max_shard_bytes), config.json, and with
    --with-optimizer an optimizer.pt whose param_groups carry the parameter names."""
    sharded = (source.spec.tp, source.spec.pp) if isinstance(source, NxdReader) else None
    if isinstance(source, OptimumNeuronReader):
        sharded = source.tp, source.pp
    if sharded is not None:
        if opts.tp is not None and opts.tp != sharded[0]:
            raise UsageError(f"--tp {opts.tp} does not match the checkpoint, which is sharded tp {sharded[0]}")
        if opts.pp is not None and opts.pp != sharded[1]:
            raise UsageError(f"--pp {opts.pp} does not match the checkpoint, which is sharded pp {sharded[1]}")
    optimizer = source.optimizer_state() if opts.with_optimizer else None
    if opts.with_optimizer and optimizer is None:
        raise UsageError(f"--with-optimizer: {source.description} holds no optimizer state")
    names = source.keys()
    with staged_destination(dest, opts.overwrite) as out:
        files = _write_safetensors(source, output_names(source), opts.dtype, out, opts.max_shard_bytes)
        if source.config is not None:
            (out / "config.json").write_text(json.dumps(source.config, indent=2))
        if optimizer is not None:
            ordered = [n for n in names if n in optimizer]
            state = {
                "state": {i: optimizer[n] for i, n in enumerate(ordered)},
                "param_groups": [{"params": list(range(len(ordered))), "param_names": ordered}],
            }
            save_and_free(state, out / "optimizer.pt")
        _check_gpu_output(out, dest)
    stripped = source.spec.vocab_padding if isinstance(source, NxdReader) else 0
    return {
        "to": "gpu",
        "files": files,
        "tensors": len(names),
        "optimizer": optimizer is not None,
        "vocab_padding_stripped": stripped,
        "destination": str(dest),
    }


def _check_gpu_output(out: Path, dest: Path) -> None:
    written = open_gpu_checkpoint(out)
    if written.config is None:
        log.warning("no model config known: %s is not checked to load into its model", dest)
        return
    loaded = loaded_names(written.keys(), written.config)  # the names transformers loads them under
    check_loads(written.config, {n: written.meta(k)[0] for n, k in loaded.items()}, f"the output for {dest}")


def _source_report(source: TensorSource) -> dict:
    report = {"layout": source.layout, "writer": source.writer}
    if isinstance(source, MappedSource):
        report |= {"prefix": source.mapping.strip, "not_converted": len(source.extras)}
        if source.merged:
            report["merged"] = sum(map(len, source.merged.values()))  # checkpoint tensors merged on the way in
        if source.extras:
            log.info(
                "%d entries of %s are not model tensors and are not converted (first: %s)",
                len(source.extras),
                source.description,
                source.extras[0],
            )
    return report


def migrate(src: Path, dest: Path, opts: MigrateOptions) -> dict:
    if dest.resolve() == src.resolve():
        raise UsageError("the destination is the source")
    source = open_model_checkpoint(src, opts.config)
    result = to_neuron(source, dest, opts) if opts.to == "neuron" else to_gpu(source, dest, opts)
    return {**result, "source": _source_report(source)}
