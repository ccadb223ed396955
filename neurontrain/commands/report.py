"""`neurontrain report RUN_DIR [RUN_DIR ...] [-o report.html]`: one self-contained HTML page of one or more runs,
their curves overlaid: losses, throughput, compiles, padding per bucket, memory plan, health, restarts."""

from __future__ import annotations

import argparse
from pathlib import Path

from neurontrain.errors import UsageError
from neurontrain.fileio import write_file_atomic
from neurontrain.report.page import render
from neurontrain.report.runs import load_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="a run's --output-dir")
    parser.add_argument("-o", "--output", type=Path, default=Path("report.html"), help="the page to write")


def run(args: argparse.Namespace) -> int:
    if args.output.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"-o {args.output}: the report is an HTML file (name it .html)")
    page = render(load_runs(args.runs))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(args.output, page.encode())
    print(f"wrote {args.output} ({len(args.runs)} run{'s' if len(args.runs) > 1 else ''})")
    return 0
