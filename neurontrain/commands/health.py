"""`neurontrain health`: device and collective checks across torchrun workers; exit 3 on failure."""

from __future__ import annotations

import argparse
from pathlib import Path

from neurontrain.commands.arguments import add_backend_argument, add_topology_arguments, options_from
from neurontrain.errors import HealthCheckFailed, UsageError
from neurontrain.fileio import write_json_atomic
from neurontrain.health.runner import HealthOptions, format_table, run_health
from neurontrain.logs import get_logger

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_topology_arguments(parser, nproc_per_node=2, master_port=None, elastic=False)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole check (default 60)")
    parser.add_argument("--sizes", default="1K,64K,1M", help="collective sizes in bytes (K/M suffixes)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--min-busbw", type=float, help="fail when the largest size's busbw (GB/s) is below this")
    parser.add_argument("--expect-devices", type=int, help="devices each worker must see")
    add_backend_argument(parser, default="auto")
    parser.add_argument("--json", dest="json_file", help="write every figure to this file")
    parser.add_argument("--work-dir", help="where workers write their progress (default: a temporary directory)")
    parser.add_argument(
        "--hosts",
        help="every node's address, node 0 first (HOST0,HOST1,...): with --nnodes > 1 on Neuron hosts, node 0 "
        "runs nccom-test across them (MPI mode); without it, inside a Slurm allocation, Slurm mode",
    )


def parse_size(text: str) -> int:
    """A byte count with an optional K/M/G suffix, as --sizes takes it."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    try:
        return int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise UsageError(f"bad size {text!r} in --sizes (use e.g. 1K,64K,1M)") from None


def run(args: argparse.Namespace) -> int:
    options = options_from(
        HealthOptions,
        args,
        sizes=[parse_size(size) for size in args.sizes.split(",")],
        min_busbw_gibps=args.min_busbw,
        work_dir=Path(args.work_dir) if args.work_dir else None,
        hosts=[h.strip() for h in args.hosts.split(",") if h.strip()] if args.hosts else None,
    )
    result = run_health(options)
    log.info(format_table(result))  # the report for people; --json keeps every figure
    if args.json_file:
        write_json_atomic(Path(args.json_file), result)
    if not result["ok"]:
        first = (
            result["bad_ranks"][0]
            if result["bad_ranks"]
            else {"rank": "?", "host": "?", "check": "-", "problem": "below the busbw threshold"}
        )
        raise HealthCheckFailed(
            f"health check failed: rank {first['rank']} on {first['host']}: {first['problem']} ({first['check']})"
        )
    return 0
