"""`neurontrain compare RUN_A RUN_B`: is it the same model? Loss curves aligned by steps, samples or real tokens,
the chosen metric's difference against a tolerance (exit 1 beyond it, 2 for runs that cannot be compared), and
throughput, compiles, padding and cost per million real tokens side by side."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from neurontrain.errors import UsageError
from neurontrain.fileio import write_file_atomic
from neurontrain.report.comparison import METRICS, Comparison, NotComparable, compare
from neurontrain.report.prices import PRICES, Price
from neurontrain.report.runs import load_run
from neurontrain.report.series import AXES, relative_difference


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", type=Path, help="the reference run's --output-dir (e.g. the GPU run)")
    parser.add_argument("run_b", type=Path, help="the run to check against it")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest metric difference that passes")
    parser.add_argument(
        "--metric",
        choices=("auto", *METRICS),
        default="auto",
        help="the quality figure judged; auto: eval_loss where both runs have it, else train_loss (the larger of "
        "the final training loss's and the aligned curve's relative differences)",
    )
    parser.add_argument("--by", choices=AXES, default="samples", help="axis the loss curves are aligned on")
    parser.add_argument("--json", type=Path, metavar="F", help="also write the comparison as JSON to F")
    parser.add_argument(
        "--instance", action="append", default=[], metavar="A|B=TYPE", help="instance type of run A or B"
    )
    parser.add_argument(
        "--price", action="append", default=[], metavar="TYPE=USD[/DEVICES]", help="an hourly price to use"
    )


def run(args: argparse.Namespace) -> int:
    if args.tolerance < 0:
        raise UsageError(f"--tolerance must not be negative (got {args.tolerance})")
    prices = _prices(args.price)
    instances = _instances(args.instance, prices)
    a, b = load_run(args.run_a), load_run(args.run_b)
    try:
        result = compare(
            (a.summary, a.records),
            (b.summary, b.records),
            tolerance=args.tolerance,
            metric=args.metric,
            by=args.by,
            instances=instances,
            prices=prices,
        )
    except NotComparable as exc:
        raise UsageError(f"cannot compare {args.run_a} and {args.run_b}: {exc}") from None
    print(render(result, str(args.run_a), str(args.run_b)))
    if args.json:
        write_file_atomic(args.json, (json.dumps(result.to_json(), indent=2) + "\n").encode())
    return 0 if result.within else 1


def _instances(pairs: list[str], prices: dict[str, Price]) -> tuple[str | None, str | None]:
    chosen: dict[str, str] = {}
    for pair in pairs:
        which, _, kind = pair.partition("=")
        if which not in ("A", "B") or not kind:
            raise UsageError(f"--instance {pair!r}: expected A=TYPE or B=TYPE")
        if kind not in prices:
            raise UsageError(f"--instance {pair!r}: no price for {kind} (known: {', '.join(sorted(prices))}; --price)")
        chosen[which] = kind
    return chosen.get("A"), chosen.get("B")


def _prices(pairs: list[str]) -> dict[str, Price]:
    prices = dict(PRICES)
    for pair in pairs:
        kind, _, value = pair.partition("=")
        usd, _, devices = value.partition("/")
        try:
            known = prices.get(kind)
            count = int(devices) if devices else (known.devices if known else 1)
            prices[kind] = Price(float(usd), count, "--price on the command line", "now")
        except ValueError:
            raise UsageError(f"--price {pair!r}: expected TYPE=USD_PER_HOUR[/DEVICES]") from None
    return prices


def render(result: Comparison, name_a: str, name_b: str) -> str:
    """The comparison as text: verdict, curve differences, then one column per run."""
    kind = "absolute" if result.metric == "eval_accuracy" else "relative"
    verdict = "within" if result.within else "BEYOND"
    lines = [f"A: {name_a}", f"B: {name_b}"]
    if result.metric_reason is not None:
        lines.append(f"metric: {result.metric} ({result.metric_reason})")
    values = f"A {result.metric_values[0]:.6g}, B {result.metric_values[1]:.6g}"
    if result.metric == "train_loss":
        final = relative_difference(*result.metric_values)
        judged = (
            f"final training loss: {values}, relative difference {final:.3g}; with the aligned curve's largest, "
            f"{result.metric_difference:.3g}"
        )
    else:
        judged = f"{result.metric}: {values}, {kind} difference {result.metric_difference:.3g}"
    lines += [
        f"{judged} ({verdict} tolerance {result.tolerance:g})",
        f"loss curves aligned by {result.by} at {result.points} points: max relative difference "
        f"{result.max_loss_difference:.3g} (at {result.max_loss_difference_at:g}), "
        f"final {result.final_loss_difference:.3g}",
    ]
    rows = [
        ("backend", "backend", "{}"),
        ("real tokens/s", "tokens_per_second", "{:.1f}"),
        ("MFU", "mfu", "{:.2%}"),
        ("compilations", "compilations", "{}"),
        ("compile seconds", "compile_seconds", "{:.1f}"),
        ("padding", "padding_fraction", "{:.1%}"),
        ("instance", "instance_type", "{}"),
        ("USD / M real tokens", "usd_per_million_tokens", "{:.4g}"),
    ]
    lines.append(f"{'':22}{'A':>24}{'B':>24}")
    for label, key, fmt in rows:
        missing = "n/a" if key == "mfu" else "-"
        cells = [fmt.format(r[key]) if r[key] is not None else missing for r in result.runs]
        lines.append(f"{label:22}{cells[0]:>24}{cells[1]:>24}")
    sources = sorted({r["price_source"] for r in result.runs if r["price_source"]})
    lines += [f"price: {s}" for s in sources]
    if not any(r["usd_per_million_tokens"] for r in result.runs):
        lines.append("cost: no instance type in the summaries; give --instance A=TYPE / B=TYPE")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)
