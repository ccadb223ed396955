"""Bad input through a real process: exit 2, one readable line on stderr, no traceback. (The many recipe and
flag cases run in process: tests/unit/test_bad_input_in_process.py.)"""

from pathlib import Path

import pytest
from bad_input import assert_one_line_usage_error, mutate
from conftest import RECIPES, run_cli

RECIPE_CASES = {
    "unknown nested key": (mutate("train.learning_rate", 0.1), "train.learning_rate: unknown key"),
    "not yaml": ("name: [unclosed\n", "not valid YAML"),
}


@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
def test_malformed_recipe(tmp_path: Path, case: str):
    text, expected = RECIPE_CASES[case]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    assert_one_line_usage_error(run_cli("run", str(recipe), "--dry-run"), expected)


def test_bad_set_expression():
    result = run_cli("run", str(RECIPES / "tiny-bert-classification.yaml"), "--dry-run", "--set", "train.max_stepz=3")
    assert_one_line_usage_error(result, "train.max_stepz: unknown key")


def test_unknown_command_and_flag():
    assert_one_line_usage_error(run_cli("fly"), "invalid choice")
    assert_one_line_usage_error(
        run_cli("run", str(RECIPES / "tiny-bert-classification.yaml"), "--speed=9"), "unrecognized arguments"
    )


def test_missing_pretrained_model_offline(tmp_path: Path):
    result = run_cli(
        "run",
        str(RECIPES / "tiny-bert-classification.yaml"),
        "--dry-run",
        "--set",
        f"model={{pretrained: {tmp_path / 'no-model'}}}",
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-1500:]


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--xla_made_up_flag=1", "XLA has no flag --xla_made_up_flag"),
        ("--model-type=transformer", "is not an XLA flag"),
    ],
)
def test_a_bad_xla_flag_is_refused_before_xla_sees_it(tmp_path, flag, message):
    """XLA aborts the whole process on an unknown XLA_FLAGS entry; the toolkit checks first."""
    res = run_cli(
        "run",
        str(RECIPES / "tiny-llama-clm.yaml"),
        "--set",
        f"runtime.xla_flags=[{flag}]",
        "--no-preflight",
        "--output-dir",
        str(tmp_path / "run"),
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.stderr
