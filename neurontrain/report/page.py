"""The report page: one self-contained HTML file (inline SVG plots and CSS, no script, nothing fetched)."""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from typing import Any

from neurontrain.report import plots
from neurontrain.report.runs import RunFiles

FIGURES = (  # summary.json fields of the runs table, with their headings
    ("recipe", "recipe"),
    ("backend", "backend"),
    ("steps", "steps"),
    ("world_size", "workers"),
    ("effective_batch", "batch"),
    ("first_loss", "first loss"),
    ("final_loss", "final loss"),
    ("eval_loss", "eval loss"),
    ("eval_accuracy", "eval accuracy"),
    ("tokens_per_second", "real tokens/s"),
    ("mfu", "MFU"),
    ("compilations", "compilations"),
    ("compile_seconds", "compile s"),
    ("unexpected_graphs", "unexpected graphs"),
    ("padding_fraction", "padding"),
    ("bucket_mode", "buckets"),
    ("wall_seconds", "wall s"),
    ("restarts", "restarts"),
    ("resumed_from_step", "resumed from"),
    ("instance_type", "instance"),
)

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px}
th{background:#f3f3f3}figure{margin:1em 0}figure svg{max-width:100%;height:auto}.bad{color:#b00}
figcaption{font-size:13px;color:#555}"""


def render(runs: list[RunFiles]) -> str:
    """The whole page for one or more runs (their plots overlaid)."""
    title = "neurontrain report: " + ", ".join(run.name for run in runs)
    parts = [f"<h1>{_e(title)}</h1>", _runs_table(runs), *_plots(runs)]
    parts += [_compile_table(runs), _issues(runs), _health(runs), _restarts(runs)]
    head = f'<meta charset="utf-8"><title>{_e(title)}</title><style>{STYLE}</style>'
    return f"<!DOCTYPE html>\n<html><head>{head}</head><body>\n" + "\n".join(parts) + "\n</body></html>\n"


def _plots(runs: list[RunFiles]) -> list[str]:
    batches = {run.summary.get("effective_batch") for run in runs}
    wanted: list[tuple[str, str, Callable[[], str | None]]] = [
        ("loss-by-step", "Loss by optimizer step (dots: evaluations)", lambda: plots.loss_curves(runs, "steps")),
    ]
    if len(batches) > 1:
        wanted.append(("loss-by-samples", "Loss by samples trained", lambda: plots.loss_curves(runs, "samples")))
    wanted += [
        ("loss-by-tokens", "Loss by real tokens trained", lambda: plots.loss_curves(runs, "tokens")),
        ("throughput", "Real (non-padding) tokens a second", lambda: plots.throughput(runs)),
        ("compile-timeline", "Compiles: graph, seconds, expected or not", lambda: plots.compile_timeline(runs)),
        ("bucket-padding", "Padding per bucket (packed runs: fill)", lambda: plots.bucket_padding(runs)),
        ("memory-plan", "Memory plan: estimate per core of each configuration tried", lambda: plots.memory_plan(runs)),
    ]
    out = []
    for name, caption, draw in wanted:
        svg = draw()
        body = svg if svg is not None else "<p>nothing recorded for this plot</p>"
        out.append(f'<h2>{_e(caption)}</h2>\n<figure class="plot" data-plot="{name}" data-drawn="{svg is not None}">')
        out.append(f"{body}<figcaption>{_e(caption)}</figcaption></figure>")
    return out


def _runs_table(runs: list[RunFiles]) -> str:
    head = "<tr><th>run</th>" + "".join(f"<th>{_e(label)}</th>" for _, label in FIGURES) + "</tr>"
    rows = []
    for i, run in enumerate(runs):
        cells = "".join(
            f'<td data-field="{key}" data-value="{_e(json.dumps(run.summary.get(key)))}">'
            f"{_e(_cell(run.summary, key))}</td>"
            for key, _ in FIGURES
        )
        rows.append(f'<tr data-run="{i}"><td title="{_e(str(run.path))}">{_e(run.name)}</td>{cells}</tr>')
    return '<h2>Runs</h2>\n<table id="runs">' + head + "".join(rows) + "</table>"


def _compile_table(runs: list[RunFiles]) -> str:
    rows = [
        [run.name, c["step"], "/".join(c["key"]), c["graphs"], f"{c['seconds']:.2f}", "yes" if c["expected"] else "NO"]
        for run in runs
        for c in run.summary.get("compiles") or []
    ]
    return _table("Compiles", "compiles", ["run", "step", "graph", "graphs", "seconds", "expected"], rows)


def _issues(runs: list[RunFiles]) -> str:
    unexpected = [
        [run.name, u.get("step"), "/".join(map(str, u.get("key", []))), json.dumps(u.get("shapes", {})), _reason(u)]
        for run in runs
        for u in run.summary.get("unexpected") or []
    ]
    syncs = [
        [run.name, s.get("step"), s.get("kind"), s.get("extra_executions"), "a host read inside the step"]
        for run in runs
        for s in run.summary.get("hidden_host_syncs") or []
    ]
    return _table("Unexpected graphs", "unexpected", ["run", "step", "graph", "shapes", "reason"], unexpected) + _table(
        "Hidden host syncs", "hidden-syncs", ["run", "step", "kind", "extra executions", "reason"], syncs
    )


def _reason(event: dict) -> str:
    return "; ".join([event.get("reason", ""), *event.get("why", [])])


def _health(runs: list[RunFiles]) -> str:
    rows = []
    for run in runs:
        for record in run.preflight:
            for rank in record.get("ranks", []):
                for check in rank.get("checks", []):
                    status = "ok" if check.get("ok") else f"FAILED: {check.get('problem', '')}"
                    row = [run.name, record.get("restart"), rank.get("rank"), rank.get("host"), check.get("check")]
                    rows.append([*row, status, check.get("seconds")])
    headings = ["run", "restart", "rank", "host", "check", "result", "seconds"]
    return _table("Health: preflight checks at each (re)start", "preflight", headings, rows)


def _restarts(runs: list[RunFiles]) -> str:
    rows = [
        [
            run.name,
            run.summary.get("restarts", 0),
            _fmt(run.summary.get("resumed_from_step")),
            len(run.preflight),
            ", ".join(str(c.get("step")) for c in run.checkpoints) or "-",
        ]
        for run in runs
    ]
    headings = ["run", "worker restarts", "resumed from step", "(re)starts with preflight", "checkpoints kept"]
    return _table("Restarts and resumes", "restarts", headings, rows)


def _table(title: str, table_id: str, headings: list[str], rows: list[list[Any]]) -> str:
    if not rows:
        return f'<h2>{_e(title)}</h2>\n<p id="{table_id}">none</p>'
    head = "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in headings) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{_e(_fmt(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f'<h2>{_e(title)}</h2>\n<table id="{table_id}">{head}{body}</table>'


def _cell(summary: dict, key: str) -> str:
    """A runs-table cell: MFU as a percentage, or n/a and why (a CPU, a device of unknown peak)."""
    if key != "mfu":
        return _fmt(summary.get(key))
    if summary.get("mfu") is not None:
        return f"{summary['mfu']:.2%}"
    reason = (summary.get("mfu_basis") or {}).get("reason")
    return f"n/a ({reason})" if reason else "-"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _e(text: str) -> str:
    return html.escape(text, quote=True)
