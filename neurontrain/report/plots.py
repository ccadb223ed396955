"""The report's plots, drawn by matplotlib as SVG text to inline in the page (no script, no network at view
time). Every function takes the runs and returns one SVG, or None when no run has what the plot shows."""

from __future__ import annotations

import io
from typing import Any

from neurontrain.report import series
from neurontrain.report.runs import RunFiles

STYLES = ("-", "--", ":", "-.")  # runs that agree draw on top of each other: each run its own dash
CATEGORIES = ("parameters", "gradients", "optimizer", "master", "activations", "logits", "autocast", "runtime")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: draw to files
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "neurontrain", "figure.dpi": 100})
    return plt


def _svg(fig: Any) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight")
    _pyplot().close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # without the XML declaration and doctype, to inline in HTML


def loss_curves(runs: list[RunFiles], by: str) -> str | None:
    """Training loss (lines) and evaluation loss (markers) of every run against steps, samples or tokens."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    drawn = False
    for i, run in enumerate(runs):
        train = series.curve(run.records, run.summary, "loss", by)
        evals = series.curve(run.records, run.summary, "eval_loss", by)
        if train:
            style = STYLES[i % len(STYLES)]
            line = ax.plot(*zip(*train), style, label=f"{run.name} loss", linewidth=1.4 + 0.8 * (i == 0))[0]
            drawn = True
            if evals:
                marker = "os^v"[i % 4]
                ax.plot(*zip(*evals), marker, color=line.get_color(), fillstyle="none", label=f"{run.name} eval_loss")
        resumed = run.summary.get("resumed_from_step")
        if resumed and by == "steps":
            ax.axvline(resumed, linestyle=":", color="grey")
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel({"steps": "optimizer step", "samples": "samples trained", "tokens": "real tokens trained"}[by])
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _svg(fig)


def throughput(runs: list[RunFiles]) -> str | None:
    """Real tokens a second at each logged step, against seconds since the run's first logged step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    drawn = False
    by_step = False
    for run in runs:
        logged = [r for r in run.train if r.get("tokens_per_second") is not None]
        points = [(r["time"], r["tokens_per_second"]) for r in logged if "time" in r]
        if not points:
            points = [(float(r["step"]), r["tokens_per_second"]) for r in logged]
            label, by_step = f"{run.name} (by step: no times recorded)", True
        else:
            start = points[0][0]
            points = [(t - start, v) for t, v in points]
            label = run.name
        if points:
            ax.plot(*zip(*points), marker=".", label=label)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("seconds since the first logged step" + (" (or step)" if by_step else ""))
    ax.set_ylabel("real tokens / s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _svg(fig)


def compile_timeline(runs: list[RunFiles]) -> str | None:
    """One bar per sync that compiled: its graph key, seconds, and whether the plan expected it."""
    rows = [(run.name, c) for run in runs for c in run.summary.get("compiles") or []]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.35 * len(rows)))
    labels = [f"{name}: {'/'.join(c['key'])} @ step {c['step']}" for name, c in rows]
    colors = ["tab:green" if c["expected"] else "tab:red" for _, c in rows]
    ax.barh(range(len(rows)), [c["seconds"] for _, c in rows], color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("compile seconds (green: expected by the plan, red: unexpected)")
    ax.grid(axis="x", alpha=0.3)
    return _svg(fig)


def bucket_padding(runs: list[RunFiles]) -> str | None:
    """Per bucket, the share of slots that were padding (packed runs: the rows' fill), one bar per run."""
    with_buckets = [r for r in runs if r.summary.get("bucket_tokens")]
    if not with_buckets:
        return None
    plt = _pyplot()
    buckets = sorted({b["bucket"] for r in with_buckets for b in r.summary["bucket_tokens"]})
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(with_buckets)
    for i, run in enumerate(with_buckets):
        packed = run.summary.get("bucket_mode") == "packed"
        share = {b["bucket"]: _share(b, packed) for b in run.summary["bucket_tokens"]}
        xs = [j + i * width for j, bucket in enumerate(buckets) if bucket in share]
        label = f"{run.name} ({'fill of packed rows' if packed else 'padding'})"
        ax.bar(xs, [share[b] for b in buckets if b in share], width=width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(buckets))], [str(b) for b in buckets])
    ax.set_xlabel("bucket (sequence length)")
    ax.set_ylabel("share of the bucket's slots")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    return _svg(fig)


def _share(bucket: dict, packed: bool) -> float:
    real = bucket["real_tokens"] / max(bucket["slots"], 1)
    return real if packed else 1.0 - real


def memory_plan(runs: list[RunFiles]) -> str | None:
    """The planner's per-core estimate of each configuration tried, stacked by category (GiB)."""
    columns = [
        (f"{run.name}\n{_label(c['config'])}", c["gib"])
        for run in runs
        for c in (run.summary.get("memory_plan") or {}).get("candidates", [])
    ]
    if not columns:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    bottoms = [0.0] * len(columns)
    for category in CATEGORIES:
        heights = [gib.get(category, 0.0) for _, gib in columns]
        ax.bar(range(len(columns)), heights, bottom=bottoms, label=category)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    cores = {run.summary["memory_plan"]["core_gib"] for run in runs if run.summary.get("memory_plan")}
    for core in cores:
        ax.axhline(core, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(columns)), [label for label, _ in columns], fontsize=8)
    ax.set_ylabel("GiB per core (dashed: the core's memory)")
    ax.legend(fontsize=7, ncol=4)
    return _svg(fig)


def _label(config: dict) -> str:
    parts = ["ZeRO-1" if config.get("zero1") else "DP"]
    if config.get("activation_checkpointing") not in (None, "none"):
        parts.append(str(config["activation_checkpointing"]))
    if (config.get("tp") or 1) > 1:
        parts.append(f"TP{config['tp']}")
    return "+".join(parts)
