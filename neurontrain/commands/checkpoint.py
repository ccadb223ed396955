"""`neurontrain checkpoint migrate|verify|inspect`: checkpoints between GPU and Trainium (NxD) layouts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from neurontrain.checkpoint.migrate import MigrateOptions, migrate
from neurontrain.checkpoint.report import describe, inspect_checkpoint
from neurontrain.checkpoint.verify import verify
from neurontrain.commands.arguments import options_from
from neurontrain.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="checkpoint_command", parser_class=type(parser))
    mig = sub.add_parser(
        "migrate", help="convert SRC to DST (HF/torch/FSDP/DCP <-> NxD / optimum-neuron per-rank shards)"
    )
    mig.add_argument("src")
    mig.add_argument("dst")
    mig.add_argument("--to", required=True, choices=["neuron", "gpu"])
    mig.add_argument("--tp", type=int, help="tensor-parallel degree (neuron side)")
    mig.add_argument("--pp", type=int, help="pipeline-parallel degree (neuron side)")
    mig.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="cast floating-point tensors")
    mig.add_argument("--fuse-qkv", action="store_true", help="fuse q/k/v into one qkv_proj.weight_qkv per rank")
    mig.add_argument("--with-optimizer", action="store_true", help="also migrate AdamW moments")
    mig.add_argument(
        "--layout",
        choices=["neurontrain", "nxd", "optimum-neuron"],
        default="neurontrain",
        help="--to neuron: whose checkpoint to write: neurontrain (what `run` loads; the default), nxd (NxD "
        "save_checkpoint's <dst>/<tag>/), optimum-neuron (its save_pretrained's <dst>/shards/ with its metadata and "
        "its parameter names at that TP)",
    )
    mig.add_argument("--tag", help="--layout nxd: the tag directory (default: migrated)")
    mig.add_argument(
        "--xser",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--layout nxd|optimum-neuron: torch-xla serialization, a file per tensor (default: the trainer's: "
        "on for optimum-neuron, off for nxd)",
    )
    mig.add_argument("--config", help="Hugging Face config (directory or config.json) when SRC has none")
    mig.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    mig.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file --to gpu writes, as Hugging Face writes sizes: 5GB (the default), 500MB, 2GiB",
    )
    mig.add_argument(
        "--pad-vocab-to-multiple-of",
        type=int,
        metavar="N",
        help="--to neuron: zero-pad the vocabulary to a multiple of N and of --tp (without it: padded to a "
        "multiple of --tp only when needed)",
    )
    ver = sub.add_parser("verify", help="compare two checkpoints tensor by tensor (any formats)")
    ver.add_argument("a")
    ver.add_argument("b")
    ver.add_argument("--atol", type=float, default=0.0, help="tolerated max abs difference (default: bit-identical)")
    ver.add_argument("--logits", metavar="RECIPE_OR_CONFIG", help="also compare model outputs on a sample input")
    ver.add_argument("--config", help="Hugging Face config for sources without one")
    ver.add_argument("--json", action="store_true")
    ins = sub.add_parser("inspect", help="what a checkpoint is: layout, writer, model prefix, tensors, optimizer")
    ins.add_argument("src")
    ins.add_argument("--config", help="Hugging Face config (directory or config.json) when SRC has none")
    ins.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.checkpoint_command is None:
        raise UsageError("checkpoint needs a command: migrate, verify, inspect")
    if args.checkpoint_command == "inspect":
        return _inspect(args)
    return _migrate(args) if args.checkpoint_command == "migrate" else _verify(args)


def _inspect(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(Path(args.src), Path(args.config) if args.config else None)
    print(json.dumps(report, indent=2) if args.json else "\n".join(describe(report)))
    return 0


def _migrate(args: argparse.Namespace) -> int:
    shard_size = {"max_shard_bytes": _size_in_bytes(args.max_shard_size)} if args.to == "gpu" else {}
    options = options_from(
        MigrateOptions,
        args,
        config=Path(args.config) if args.config else None,
        pad_vocab_multiple=args.pad_vocab_to_multiple_of,
        **shard_size,
    )
    print(json.dumps(migrate(Path(args.src), Path(args.dst), options)))
    return 0


def _size_in_bytes(size: str) -> int:
    from transformers.utils.hub import convert_file_size_to_int  # lazy: --to gpu only

    try:
        return convert_file_size_to_int(size.strip())
    except ValueError:
        raise UsageError(f"--max-shard-size {size!r}: a whole number and a unit, e.g. 5GB, 500MB or 2GiB") from None


def _verify(args: argparse.Namespace) -> int:
    config, logits = (Path(args.config) if args.config else None), (Path(args.logits) if args.logits else None)
    result = verify(Path(args.a), Path(args.b), args.atol, config, logits)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_comparison(result, logits=bool(args.logits))
    return 0 if result["equal"] else 1


def _print_comparison(result: dict, logits: bool) -> None:
    print(
        f"{result['tensors']} tensors compared, max abs diff {result['max_abs_diff']:.3g}, "
        f"missing in B {len(result['missing_in_b'])}, extra in B {len(result['extra_in_b'])}, "
        f"differing {len(result['differing'])}"
        + (f", logits max abs diff {result['logits_max_abs_diff']:.3g}" if logits else "")
        + (": EQUAL" if result["equal"] else ": DIFFERENT")
    )
    for row in result["differing"][:20]:
        print(
            f"  {row['name']}: {row['status']} {row['shape_a']}/{row['shape_b']} "
            f"{row['dtype_a']}/{row['dtype_b']} {row.get('max_abs_diff', '')}"
        )
    for name in result["missing_in_b"][:20]:
        print(f"  {name}: missing in B")
    for name in result["extra_in_b"][:20]:
        print(f"  {name}: extra in B")
