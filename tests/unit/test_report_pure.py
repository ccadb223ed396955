"""The pure logic behind `report` and `compare`: curves on each axis, alignment, relative differences, the price
math, when runs cannot be compared, and the commands' bad input (one line, exit 2)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import cli_in_process

from neurontrain.report import series
from neurontrain.report.comparison import NotComparable, compare
from neurontrain.report.prices import PRICES, Price, cost_per_million_tokens, instances_for


def _summary(**changes):
    base = {
        "recipe": "r",
        "backend": "eager",
        "steps": 4,
        "effective_batch": 8,
        "samples_trained": 32,
        "world_size": 1,
        "tokens_per_second": 1000.0,
        "eval_loss": 2.0,
        "eval_accuracy": 0.5,
        "final_loss": 2.1,
        "model_fingerprint": "m",
        "data_fingerprint": "d",
        "compilations": 0,
        "compile_seconds": 0.0,
        "padding_fraction": 0.25,
    }
    return {**base, **changes}


def _records(losses, tokens_per_step=100):
    return [
        {"step": s, "loss": v, "tokens_seen": s * tokens_per_step, "tokens_per_second": 10.0 * s}
        for s, v in enumerate(losses, start=1)
    ]


def test_a_curve_keeps_the_later_record_of_a_step_logged_twice_and_skips_what_was_not_recorded():
    records = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 9.0},
        {"step": 2, "loss": 2.0},
        {"step": 2, "eval_loss": 1},
    ]
    assert series.curve(records, _summary(), "loss") == [(1.0, 3.0), (2.0, 2.0)]
    assert series.curve(records, _summary(), "loss", "samples") == [(8.0, 3.0), (16.0, 2.0)]
    assert series.curve(records, _summary(), "loss", "tokens") == []  # no tokens_seen in these records
    packed = _summary(samples_trained=100, steps=4)  # a packed row holds several samples
    assert series.samples_per_step(packed) == 25.0


def test_alignment_interpolates_b_at_a_points_inside_b_range():
    a = [(0.0, 1.0), (5.0, 2.0), (10.0, 3.0), (20.0, 4.0)]
    b = [(0.0, 1.0), (10.0, 5.0)]
    assert series.align(a, b) == [(0.0, 1.0, 1.0), (5.0, 2.0, 3.0), (10.0, 3.0, 5.0)]
    assert series.relative_difference(2.0, 2.5) == 0.25


def test_cost_per_million_real_tokens_charges_whole_instances():
    assert instances_for("trn1.32xlarge", 32) == 1 and instances_for("trn1.32xlarge", 33) == 2
    one = cost_per_million_tokens("trn1.32xlarge", 32, 10_000.0)
    assert one == pytest.approx(21.50 / 36.0)  # 36 M tokens an hour
    assert cost_per_million_tokens("trn1.32xlarge", 64, 20_000.0) == pytest.approx(one)
    assert cost_per_million_tokens("trn1.32xlarge", 1, 0.0) is None
    assert all(p.source and p.date and p.usd_per_hour > 0 for p in PRICES.values())


def test_runs_with_different_batches_align_by_samples_and_the_verdict_is_the_metric():
    a = (_summary(), _records([4.0, 3.0, 2.0, 1.0]))  # batch 8: samples 8, 16, 24, 32
    b_summary = _summary(effective_batch=16, samples_trained=64, eval_loss=2.001)
    b = (b_summary, _records([2.0, 1.0, 0.5, 0.25]))  # batch 16: samples 16, 32, 48, 64
    result = compare(a, b, by="samples", tolerance=1e-3)
    assert result.points == 3  # a's samples 16, 24, 32 lie within b's range
    assert result.max_loss_difference == pytest.approx(1 / 3) and result.max_loss_difference_at == 16  # 3 vs 2
    assert result.final_loss_difference == 0.0  # at 32 both are 1.0
    assert result.metric_difference == pytest.approx(0.0005) and result.within
    assert not compare(a, b, tolerance=1e-4).within
    by_steps = compare(a, b, by="steps")
    assert any("differ in batch" in n for n in by_steps.notes)


def test_accuracy_differs_absolutely_and_the_cost_uses_the_instance_given():
    a = (_summary(eval_accuracy=0.90, instance_type="p4d.24xlarge"), _records([1.0, 1.0]))
    b = (_summary(eval_accuracy=0.85), _records([1.0, 1.0]))
    result = compare(a, b, metric="eval_accuracy", instances=(None, "trn1.2xlarge"))
    assert result.metric_difference == pytest.approx(0.05) and not result.within
    costs = [r["usd_per_million_tokens"] for r in result.runs]
    assert costs == pytest.approx([32.77 / 3.6, 1.34375 / 3.6])


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"model_fingerprint": "other"}, "different model"),
        ({"data_fingerprint": "other"}, "different data"),
        ({"eval_loss": None}, "has no eval_loss"),
    ],
)
def test_runs_that_cannot_be_compared_say_why(changes, why):
    with pytest.raises(NotComparable, match=why):
        compare((_summary(), _records([1.0])), (_summary(**changes), _records([1.0])), metric="eval_loss")


def test_without_a_metric_runs_without_eval_are_judged_on_final_loss_and_curve():
    evaluated = compare((_summary(), _records([3.0, 2.1])), (_summary(eval_loss=2.0005), _records([3.0, 2.1])))
    assert (evaluated.metric, evaluated.metric_reason) == ("eval_loss", "both runs have an eval_loss")
    a = (_summary(eval_loss=None), _records([3.0, 2.1]))
    same = compare(a, (_summary(eval_loss=None), _records([3.0, 2.1])))
    assert same.metric == "train_loss" and same.within and same.metric_values == (2.1, 2.1)
    assert "run A and run B have no eval_loss" in same.metric_reason
    # the final losses agree but the curves part on the way: beyond the tolerance, as the curve's difference
    parted = compare(a, (_summary(), _records([3.3, 2.1])))
    assert "run A has no eval_loss" in parted.metric_reason
    assert not parted.within and parted.metric_difference == pytest.approx(0.1)
    lower = compare(a, (_summary(final_loss=2.4, eval_loss=None), _records([3.0, 2.4])))
    assert not lower.within and lower.metric_difference == pytest.approx(0.3 / 2.1)


def test_a_summary_without_fingerprints_is_compared_with_a_note():
    old = _summary(model_fingerprint=None)
    result = compare((_summary(), _records([1.0, 2.0])), (old, _records([1.0, 2.0])))
    assert result.within and any("model could not be checked" in n for n in result.notes)


def _run_dir(path, summary, losses):
    path.mkdir()
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(losses)))
    return str(path)


def test_the_commands_refuse_bad_input_in_one_line(tmp_path, capsys):
    a = _run_dir(tmp_path / "a", _summary(), [2.0, 1.0])
    b = _run_dir(tmp_path / "b", _summary(data_fingerprint="x"), [2.0, 1.0])
    for args, message in [
        (["compare", a, b], "different data"),
        (["compare", a, a, "--instance", "A=trn9.huge"], "no price for trn9.huge"),
        (["compare", a, a, "--instance", "C=trn1.2xlarge"], "expected A=TYPE or B=TYPE"),
        (["compare", a, a, "--price", "x=cheap"], "expected TYPE=USD_PER_HOUR"),
        (["compare", a, str(tmp_path)], "no summary.json"),
        (["report", str(tmp_path), "-o", str(tmp_path / "r.html")], "no summary.json"),
        (["report", a, "-o", str(tmp_path / "r.png")], "name it .html"),
    ]:
        code, out, err = cli_in_process(capsys, *args)
        assert code == 2 and err.startswith("neurontrain: error:") and message in err, (args, err)
        assert len(err.strip().splitlines()) == 1


def test_compare_prices_from_the_command_line(tmp_path, capsys):
    unevaluated = _run_dir(tmp_path / "u", _summary(eval_loss=None), [2.0, 1.0])
    code, out, _ = cli_in_process(capsys, "compare", unevaluated, unevaluated)
    assert code == 0 and "metric: train_loss (run A and run B have no eval_loss" in out
    assert "final training loss: A 2.1, B 2.1, relative difference 0; with the aligned curve's largest, 0" in out
    a = _run_dir(tmp_path / "a", _summary(), [2.0, 1.0])
    json_out = tmp_path / "c.json"
    code, out, _ = cli_in_process(
        capsys, "compare", a, a, "--price", "g5.xlarge=1.0/1", "--instance", "B=g5.xlarge", "--json", str(json_out)
    )
    assert code == 0 and "within tolerance" in out
    result = json.loads(json_out.read_text())
    assert result["runs"][1]["usd_per_million_tokens"] == pytest.approx(1.0 / 3.6)
    assert Price(1.0, 1, "s", "d") and math.isfinite(result["max_relative_loss_difference"])


def test_a_page_of_a_run_without_report_fields_says_what_it_cannot_draw(tmp_path, capsys):
    old = {k: v for k, v in _summary().items() if "fingerprint" not in k}
    a = _run_dir(tmp_path / "old-run", old, [2.0, 1.5, 1.0])
    code, _, err = cli_in_process(capsys, "report", a, "-o", str(tmp_path / "r.html"))
    assert code == 0, err
    page = (tmp_path / "r.html").read_text()
    assert 'data-plot="loss-by-step" data-drawn="True"' in page and page.count("<svg") == 3  # loss x2, throughput
    assert 'data-plot="compile-timeline" data-drawn="False"' in page and "nothing recorded for this plot" in page
