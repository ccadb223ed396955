"""Curves of a run against steps, samples or real tokens, and two runs' curves aligned on one axis (pure)."""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

AXES = ("steps", "samples", "tokens")
Points = list[tuple[float, float]]


def samples_per_step(summary: dict[str, Any]) -> float:
    """Training samples one optimizer step covers (a packed row holds several)."""
    steps = summary.get("steps") or 0
    trained = summary.get("samples_trained") or 0
    return trained / steps if steps and trained else float(summary.get("effective_batch") or 0)


def x_of(record: dict, summary: dict[str, Any], by: str) -> float | None:
    """Where a metrics.jsonl record sits on the `by` axis; None when the run did not record it (tokens_seen)."""
    if by == "steps":
        return float(record["step"])
    if by == "samples":
        return record["step"] * samples_per_step(summary)
    if by == "tokens":
        return record.get("tokens_seen")
    raise ValueError(f"unknown axis {by!r} (one of {', '.join(AXES)})")


def curve(records: list[dict], summary: dict[str, Any], key: str, by: str = "steps") -> Points:
    """(x, value) of every record holding `key`, in step order; the later record wins for a step logged twice
    (a resumed run logs again the steps after its checkpoint)."""
    by_step: dict[int, dict] = {}
    for record in records:
        if record.get(key) is not None:
            by_step[record["step"]] = record
    points = []
    for step in sorted(by_step):
        x = x_of(by_step[step], summary, by)
        if x is not None:
            points.append((float(x), float(by_step[step][key])))
    return points


def interpolate(points: Points, x: float) -> float | None:
    """The value of a piecewise-linear curve at x; None outside its range."""
    xs = [p[0] for p in points]
    if not points or x < xs[0] or x > xs[-1]:
        return None
    i = bisect_left(xs, x)
    if xs[i] == x:
        return points[i][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def align(a: Points, b: Points) -> list[tuple[float, float, float]]:
    """(x, a, b) at each of a's points that lies within b's range, b interpolated there."""
    out = []
    for x, ya in a:
        yb = interpolate(b, x)
        if yb is not None:
            out.append((x, ya, yb))
    return out


def relative_difference(a: float, b: float) -> float:
    """|a - b| relative to a (run A is the reference)."""
    return abs(a - b) / max(abs(a), 1e-12)
