"""A bad model.config value is bad input: a UsageError naming its key (exit 2, one line), found before any
weight is allocated, through transformers' own config class and the model built on the meta device.

The tests here start processes; the in-process ones are in tests/unit/test_model_config.py."""

from conftest import RECIPES, run_cli


def test_the_cli_exits_2_with_one_line(tmp_path):
    result = run_cli(
        "run",
        str(RECIPES / "tiny-bert-classification.yaml"),
        "--set",
        "model.config.hidden_size=-3",
        "--output-dir",
        str(tmp_path / "run"),
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert lines == ["neurontrain: error: model.config.hidden_size: -3 must not be negative (bert's default is 768)"]
