"""`neurontrain doctor`: every Neuron contract the toolkit relies on, checked on this host; exit 3 on a failure."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from neurontrain import __version__
from neurontrain.commands.arguments import add_backend_argument
from neurontrain.doctor.report import build_report, exit_code, format_table
from neurontrain.doctor.runner import DoctorOptions, run_doctor
from neurontrain.errors import UsageError
from neurontrain.fileio import write_json_atomic
from neurontrain.logs import get_logger

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick", help="environment, compile "
                      "once, collectives, data parallel, checkpoint (the default; minutes)")  # fmt: skip
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="also ZeRO-1, tensor "
                      "parallel (neuronx-distributed) and native torch.compile")  # fmt: skip
    parser.add_argument("--nproc-per-node", type=int, default=2, help="workers for the multi-worker checks (default 2)")
    add_backend_argument(parser, default="auto")
    parser.add_argument("--json", dest="json_file", help="write the report (docs/doctor.md: schema) to this file")
    parser.add_argument("--keep", help="keep the scratch runs (logs, cache, checkpoints) in this directory")


def run(args: argparse.Namespace) -> int:
    if args.nproc_per_node < 1:
        raise UsageError("--nproc-per-node must be at least 1")
    keep = Path(args.keep) if args.keep else None
    if keep is not None and keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
        raise UsageError(f"--keep {keep}: give a new or empty directory")
    options = DoctorOptions(
        mode=args.mode or "quick", nproc_per_node=args.nproc_per_node, backend=args.backend, keep=keep
    )
    started = time.time()
    results = run_doctor(options, on_result=lambda r: log.info(f"doctor: {r.name}: {r.status} ({r.seconds:.1f} s)"))
    print(format_table(results))
    if args.json_file:
        write_json_atomic(Path(args.json_file), build_report(options.mode, results, os.environ, started, __version__))
    return exit_code(results)
