"""`compare`'s judgement of two runs (pure): are they comparable, how far apart their losses and the chosen
metric are, and their throughput, compiles, padding and cost side by side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neurontrain.report import series
from neurontrain.report.prices import PRICES, Price, cost_per_million_tokens

METRICS = ("eval_loss", "final_loss", "eval_accuracy", "train_loss")
# train_loss: the larger of the final training loss's and the aligned loss curve's relative differences; `auto`
# (compare's default) takes eval_loss where both runs evaluated, else train_loss, and says so
# eval_accuracy is a share already: its difference is absolute; the losses' differences are relative to run A
ABSOLUTE_METRICS = {"eval_accuracy"}


class NotComparable(Exception):
    """The two runs cannot be compared (exit 2); the message says why."""


@dataclass
class Comparison:
    by: str
    metric: str
    tolerance: float
    points: int  # aligned points of the loss curves
    max_loss_difference: float  # relative, over the aligned points
    max_loss_difference_at: float  # where on the `by` axis
    final_loss_difference: float  # relative, at the last aligned point
    metric_values: tuple[float, float]
    metric_difference: float
    runs: list[dict[str, Any]] = field(default_factory=list)  # per run: throughput, compiles, padding, cost
    notes: list[str] = field(default_factory=list)
    metric_reason: str | None = None  # why `auto` judged this metric

    @property
    def within(self) -> bool:
        return self.metric_difference <= self.tolerance

    def to_json(self) -> dict[str, Any]:
        return {
            "by": self.by,
            "metric": self.metric,
            "tolerance": self.tolerance,
            "within_tolerance": self.within,
            "aligned_points": self.points,
            "max_relative_loss_difference": self.max_loss_difference,
            "max_relative_loss_difference_at": self.max_loss_difference_at,
            "final_relative_loss_difference": self.final_loss_difference,
            "metric_values": list(self.metric_values),
            "metric_difference": self.metric_difference,
            "metric_difference_kind": "absolute" if self.metric in ABSOLUTE_METRICS else "relative",
            "metric_reason": self.metric_reason,
            "runs": self.runs,
            "notes": self.notes,
        }


def check_comparable(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Raise NotComparable for runs of different models or data; notes for what cannot be checked."""
    notes = []
    for key, what in (("model_fingerprint", "model"), ("data_fingerprint", "data")):
        fa, fb = a.get(key), b.get(key)
        if fa is None or fb is None:
            notes.append(f"a run's summary.json has no {key}: its {what} could not be checked")
        elif fa != fb:
            raise NotComparable(f"different {what}: {key} {fa} vs {fb} (recipes {a.get('recipe')}, {b.get('recipe')})")
    return notes


def choose_metric(a: dict[str, Any], b: dict[str, Any], metric: str) -> tuple[str, str | None]:
    """The metric judged, and why where `auto` chose it: eval_loss where both runs have one, else the training
    losses (a GPU reference run often skips evaluation)."""
    if metric != "auto":
        return metric, None
    missing = [f"run {which}" for which, s in (("A", a), ("B", b)) if s.get("eval_loss") is None]
    if not missing:
        return "eval_loss", "both runs have an eval_loss"
    return "train_loss", (
        f"{' and '.join(missing)} {'has' if len(missing) == 1 else 'have'} no eval_loss: judged on the training "
        "losses, final and aligned curve (--metric chooses)"
    )


def metric_value(summary: dict[str, Any], metric: str) -> float:
    if metric not in METRICS:
        raise NotComparable(f"unknown metric {metric!r} (one of {', '.join(METRICS)})")
    value = summary.get("final_loss" if metric == "train_loss" else metric)
    if value is None:
        raise NotComparable(f"run {summary.get('recipe')!r} has no {metric} (did it evaluate?)")
    return float(value)


def compare(
    a: tuple[dict, list[dict]],
    b: tuple[dict, list[dict]],
    *,
    tolerance: float = 1e-3,
    metric: str = "auto",
    by: str = "samples",
    instances: tuple[str | None, str | None] = (None, None),
    prices: dict[str, Price] = PRICES,
) -> Comparison:
    """a, b: (summary, metrics records) of each run. instances: instance types that override the summaries'."""
    (sa, ra), (sb, rb) = a, b
    notes = check_comparable(sa, sb)
    metric, reason = choose_metric(sa, sb, metric)
    values = (metric_value(sa, metric), metric_value(sb, metric))
    ca, cb = series.curve(ra, sa, "loss", by), series.curve(rb, sb, "loss", by)
    if not ca or not cb:
        raise NotComparable(f"a run has no training losses on the {by} axis (tokens need metrics' tokens_seen)")
    aligned = series.align(ca, cb)
    if not aligned:
        raise NotComparable(f"the runs' loss curves do not overlap on the {by} axis")
    diffs = [(series.relative_difference(ya, yb), x) for x, ya, yb in aligned]
    worst, worst_at = max(diffs)
    if metric in ABSOLUTE_METRICS:
        difference = abs(values[0] - values[1])
    else:
        difference = series.relative_difference(*values)
    if metric == "train_loss":  # a curve that parts and meets again at the end does not pass
        difference = max(difference, worst)
    if sa.get("effective_batch") != sb.get("effective_batch") and by == "steps":
        notes.append("the runs differ in batch: --by samples or tokens aligns what they trained on")
    runs = [_figures(s, kind, prices) for s, kind in ((sa, instances[0]), (sb, instances[1]))]
    return Comparison(
        by, metric, tolerance, len(aligned), worst, worst_at, diffs[-1][0], values, difference, runs, notes, reason
    )


def _figures(summary: dict[str, Any], instance: str | None, prices: dict[str, Price]) -> dict[str, Any]:
    instance = instance or summary.get("instance_type")
    tps = float(summary.get("tokens_per_second") or 0.0)
    world = int(summary.get("world_size") or 1)
    cost = cost_per_million_tokens(instance, world, tps, prices) if instance in prices else None
    return {
        "recipe": summary.get("recipe"),
        "backend": summary.get("backend"),
        "tokens_per_second": tps,
        "mfu": summary.get("mfu"),
        "compilations": summary.get("compilations"),
        "compile_seconds": summary.get("compile_seconds"),
        "padding_fraction": summary.get("padding_fraction"),
        "instance_type": instance,
        "usd_per_million_tokens": cost,
        "price_source": f"{prices[instance].source}, read {prices[instance].date}" if instance in prices else None,
    }
