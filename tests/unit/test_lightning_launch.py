"""`neurontrain run --lightning`: what it refuses before any worker starts, and how a worker counts its loss
items for the gradient average."""

import pytest
import torch
from bad_input import assert_one_line_usage_error
from conftest import RECIPES, REPO, cli_in_process

from neurontrain.launch.lightning_script import script_argv
from neurontrain.lightning.parallel import loss_items

SCRIPT = str(REPO / "examples" / "lightning_tiny.py")


class _Result:
    def __init__(self, code: int, err: str) -> None:
        self.returncode, self.stderr = code, err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--lightning", f"{SCRIPT} --max-steps 4", "--set", "train.max_steps=4"], "--set belong to a recipe run"),
        (["--lightning", f"{SCRIPT}", str(RECIPES / "tiny-llama-clm.yaml")], "RECIPE belong to a recipe run"),
        (["--lightning", "missing.py --max-steps 4"], "--lightning: missing.py is not a Python script"),
        (["--lightning", f"{SCRIPT} --max-steps '4"], "No closing quotation"),
        ([], "run needs a RECIPE (or --lightning SCRIPT)"),
    ],
)
def test_what_run_lightning_refuses_is_a_one_line_usage_error(args: list[str], expected: str, capsys):
    code, _, err = cli_in_process(capsys, "run", *args)
    assert_one_line_usage_error(_Result(code, err), expected)


def test_submit_slurm_lightning_runs_the_script_on_every_node_and_refuses_recipe_options(tmp_path, capsys):
    code, out, _ = cli_in_process(
        capsys, "submit", "slurm", "--lightning", "examples/lightning_tiny.py --max-steps 4 --resume",
        "--nodes", "2", "--nproc-per-node", "1", "-o", str(tmp_path), "--job-name", "lt",
    )  # fmt: skip
    assert code == 0
    script = (tmp_path / "lt.sbatch").read_text()
    assert f"--lightning '{SCRIPT} --max-steps 4 --resume'" in script  # the script by its absolute path
    assert '--nnodes="$SLURM_JOB_NUM_NODES" --node-rank="$SLURM_NODEID" --nproc-per-node=1' in script
    code, _, err = cli_in_process(
        capsys, "submit", "slurm", "--lightning", SCRIPT, "--nodes", "2", "--compile-cache", "s3://b/p",
        "-o", str(tmp_path),
    )  # fmt: skip
    assert_one_line_usage_error(_Result(code, err), "--compile-cache belong to a recipe job")


def test_the_script_keeps_its_own_arguments():
    assert script_argv(f"{SCRIPT} --max-steps 4 --output-dir 'runs/a b'") == [
        SCRIPT,
        "--max-steps",
        "4",
        "--output-dir",
        "runs/a b",
    ]


def test_loss_items_are_labels_other_than_the_ignore_value_else_rows():
    tokens = {"input_ids": torch.zeros(2, 4), "labels": torch.tensor([[1, 2, -100, -100], [3, -100, -100, -100]])}
    assert loss_items(tokens, -100) == 3
    assert loss_items({"input_ids": torch.zeros(3, 4), "labels": torch.tensor([0, 1, 1])}, -100) == 3
    assert loss_items({"input_ids": torch.zeros(5, 4)}, -100) == 5
