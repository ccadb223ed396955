"""`neurontrain report` opened in a real headless Chromium (no console error, every plot drawn, the page's numbers
the runs' own) and `neurontrain compare` exiting 0 / 1 / 2 on real tiny runs: XLA:CPU against eager of one
recipe, another learning rate, another model. The runs are made once for the module, short and concurrently."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import REPO, cli_in_process, read_json, read_metrics, run_cli, start_cli

pytestmark = pytest.mark.slow

RECIPE = str(REPO / "recipes" / "tiny-llama-clm.yaml")
COMMON = [
    *("--set", "train.max_steps=6", "--set", "train.log_every=1", "--set", "checkpoint.every=3"),
    *("--set", "checkpoint.save_final=false", "--set", "train.precision=fp32"),
    *("--set", "model.config.attention_dropout=0.0", "--set", "data.eval_samples=16"),
]
RUNS = {  # name -> extra arguments
    "xla": ["--backend", "xla-cpu"],
    "eager": ["--backend", "eager"],
    "eager-lr": ["--backend", "eager", "--set", "train.optimizer.lr=3.0e-2"],
    "eager-1-layer": ["--backend", "eager", "--set", "model.config.num_hidden_layers=1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    dirs = {name: root / name for name in RUNS}

    def command(name: str) -> list[str]:
        return ["run", RECIPE, *COMMON, *RUNS[name], "--output-dir", str(dirs[name])]

    xla = start_cli(*command("xla"))
    for name in ("eager", "eager-lr", "eager-1-layer"):  # the eager runs while XLA compiles
        done = run_cli(*command(name), timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    out, err = xla.communicate(timeout=600)
    assert xla.returncode == 0, err[-3000:]
    assert f"neurontrain report {dirs['xla']} -o {dirs['xla'] / 'report.html'}" in err  # run says how to look
    return dirs


def _compare(runs, a: str, b: str, *extra: str) -> subprocess.CompletedProcess:
    return run_cli("compare", str(runs[a]), str(runs[b]), *extra, timeout=120)


def test_compare_xla_against_eager_of_one_recipe_is_within_1e_4(runs, tmp_path):
    result = _compare(runs, "eager", "xla", "--tolerance", "1e-4", "--json", str(tmp_path / "c.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_json(tmp_path / "c.json")
    eager, xla = read_json(runs["eager"] / "summary.json"), read_json(runs["xla"] / "summary.json")
    assert report["metric_values"] == [eager["eval_loss"], xla["eval_loss"]]
    assert report["metric_difference"] == pytest.approx(abs(eager["eval_loss"] - xla["eval_loss"]) / eager["eval_loss"])
    assert report["aligned_points"] == 6 and report["max_relative_loss_difference"] < 1e-4
    assert [r["backend"] for r in report["runs"]] == ["eager", "xla-cpu"]
    assert [r["compilations"] for r in report["runs"]] == [eager["compilations"], xla["compilations"]]
    assert "USD / M real tokens" in result.stdout


def test_compare_another_learning_rate_exits_1_and_prices_the_tokens(runs, tmp_path):
    result = _compare(runs, "eager", "eager-lr", "--instance", "B=trn1.32xlarge", "--json", str(tmp_path / "c.json"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BEYOND tolerance" in result.stdout
    b = read_json(tmp_path / "c.json")["runs"][1]
    summary = read_json(runs["eager-lr"] / "summary.json")
    assert b["usd_per_million_tokens"] == pytest.approx(21.50 / (summary["tokens_per_second"] * 3600) * 1e6)


def _without_eval(run: Path, out: Path) -> str:
    """A copy of a run as train.eval_at_end=false leaves it (a GPU reference run often does): no eval_loss."""
    shutil.copytree(run, out, ignore=shutil.ignore_patterns("checkpoints", "model"))
    summary = read_json(out / "summary.json")
    summary.update(eval_loss=None, eval_accuracy=None)
    (out / "summary.json").write_text(json.dumps(summary))
    records = [r for r in read_metrics(out / "metrics.jsonl") if "eval_loss" not in r]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(out)


def test_compare_without_eval_judges_the_training_losses(runs, tmp_path, capsys):
    eager, xla, lr = (_without_eval(runs[n], tmp_path / n) for n in ("eager", "xla", "eager-lr"))
    code, out, err = cli_in_process(capsys, "compare", eager, xla, "--tolerance", "1e-4")
    assert code == 0, out + err
    assert "metric: train_loss (run A and run B have no eval_loss" in out and "within tolerance" in out
    code, out, err = cli_in_process(capsys, "compare", eager, lr)
    assert code == 1 and "BEYOND tolerance" in out, out + err


def test_compare_another_model_exits_2_naming_why(runs):
    result = _compare(runs, "eager", "eager-1-layer")
    assert result.returncode == 2
    assert result.stderr.startswith("neurontrain: error: cannot compare") and "different model" in result.stderr
    assert "Traceback" not in result.stderr


class _Page(HTMLParser):
    """The dumped DOM: each plot figure's drawn SVG elements, and the runs table's cells."""

    def __init__(self) -> None:
        super().__init__()
        self.plots: dict[str, dict] = {}
        self.cells: list[tuple[str, str]] = []
        self._plot: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure" and "data-plot" in a:
            self._plot = a["data-plot"]
            self.plots[self._plot] = {"drawn": a.get("data-drawn") == "True", "svg": 0, "path": 0}
        elif self._plot and tag in ("svg", "path"):
            self.plots[self._plot][tag] += 1
        if tag == "td" and "data-field" in a:
            self.cells.append((a["data-field"], a["data-value"]))

    def handle_endtag(self, tag):
        if tag == "figure":
            self._plot = None


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it as root): the page is not opened")
    return found


def _open(page: Path, screenshot: Path) -> tuple[str, list[str]]:
    """Load the page in headless Chromium: (its DOM after loading, the console messages it logged)."""
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
    url = page.resolve().as_uri()
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    shot = subprocess.run(
        [*base, f"--screenshot={screenshot}", "--window-size=1200,4000", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dom.returncode == 0 and shot.returncode == 0, dom.stderr[-2000:] + shot.stderr[-2000:]
    console = [line for line in (dom.stderr + shot.stderr).splitlines() if "CONSOLE" in line]
    return dom.stdout, console


def test_the_console_check_sees_a_page_error(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text("<html><body><script>console.error('broken page')</script></body></html>")
    _, console = _open(page, tmp_path / "bad.png")
    assert any("broken page" in line for line in console)


@pytest.mark.parametrize("names", [["xla"], ["eager", "xla"]], ids=["one-run", "two-runs-overlaid"])
def test_the_report_renders_in_chromium_with_every_plot_and_the_runs_numbers(runs, tmp_path, names):
    page = tmp_path / "report.html"
    result = run_cli("report", *(str(runs[n]) for n in names), "-o", str(page), timeout=120)
    assert result.returncode == 0, result.stderr
    text = page.read_text()
    assert not re.search(r"""(src|href)=["']?https?:""", text), "the page must fetch nothing"
    dom, console = _open(page, tmp_path / "report.png")
    assert console == [], console
    assert (tmp_path / "report.png").stat().st_size > 10_000  # kept under the test's tmp dir as the artifact
    parsed = _Page()
    parsed.feed(dom)
    expected = {"loss-by-step", "loss-by-tokens", "throughput", "compile-timeline", "bucket-padding", "memory-plan"}
    assert expected <= set(parsed.plots)
    for name in expected:
        plot = parsed.plots[name]
        assert plot["drawn"] and plot["svg"] >= 1 and plot["path"] >= 5, (name, plot)
    summaries = [read_json(runs[n] / "summary.json") for n in names]
    fields = len(parsed.cells) // len(names)
    for i, summary in enumerate(summaries):
        for field, value in parsed.cells[i * fields : (i + 1) * fields]:
            assert json.loads(value) == summary.get(field), (names[i], field)
    xla = read_json(runs["xla"] / "summary.json")
    assert len(xla["compiles"]) == xla["compilations"] and all(c["expected"] for c in xla["compiles"])
    for compile_ in xla["compiles"]:  # the compile table: each graph with its seconds
        assert f"<td>{'/'.join(compile_['key'])}</td><td>1</td><td>{compile_['seconds']:.2f}</td>" in dom
    last = [m for m in read_metrics(runs["xla"] / "metrics.jsonl") if m.get("step") == 6 and "loss" in m][-1]
    assert sum(b["real_tokens"] for b in xla["bucket_tokens"]) == last["tokens_seen"]
    checks = sum(
        len(rank["checks"]) for n in names for rec in _jsonl(runs[n] / "preflight.jsonl") for rank in rec["ranks"]
    )
    assert dom.count("<td>ok</td>") == checks
    if len(names) == 2:
        assert "eager loss" in text and "xla loss" in text  # both curves on one plot


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
