"""Every `neurontrain run` argument reaches the workers by construction: each action of the real `run` parser is
either a worker argument, which the torchrun worker argv, the node command of the sbatch script `submit slurm`
writes and the SageMaker entry's command line all carry (each parses back to the value set), or declared
launcher-only, which no worker gets. An argument that is neither fails here. No training and no cluster: the
sbatch node command runs with a stand-in interpreter that records its argv, the SageMaker entry with a runner
that records its command line."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RECIPES

from neurontrain.cli import build_parser, main
from neurontrain.commands.arguments import launcher_only_dests, worker_argv, worker_dests
from neurontrain.commands.submit import SAGEMAKER_CARRIED
from neurontrain.commands.submit_batch import BATCH_CARRIED
from neurontrain.launch.batch_entry import BatchNode
from neurontrain.launch.batch_entry import run_argv as batch_node_argv
from neurontrain.launch.sagemaker_entry import main as sagemaker_entry
from neurontrain.recipe import load_recipe

LLAMA = str(RECIPES / "tiny-llama-clm.yaml")
ROLE = "arn:aws:iam::123456789012:role/Trainer"


def _run_parser() -> argparse.ArgumentParser:
    """The `run` parser exactly as `neurontrain run` builds it (through the verb registry)."""
    parser, _ = build_parser(["run"])
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return verbs.choices["run"]


RUN = _run_parser()
ACTIONS = {a.dest: a for a in RUN._actions if not isinstance(a, argparse._HelpAction)}


def _sample(action: argparse.Action, tmp_path: Path):
    """A value other than the default that the recipe's and submit's checks accept."""
    known = {
        "recipe": LLAMA,
        "output_dir": str(tmp_path / "run dir"),
        "overrides": ["train.max_steps=7", "data.text_field=a b; echo $HOME"],
    }
    if action.dest in known:
        return known[action.dest]
    if action.nargs == 0:
        return not action.default
    if action.choices:
        return next(c for c in reversed(list(action.choices)) if c != action.default)
    value = (action.type or str)("3")
    return [value] if isinstance(action, argparse._AppendAction) else value


def _submit_words(action: argparse.Action, value) -> tuple[list[str], list[str]]:
    """(recipe positional, option words) setting this argument on a submit command line (the test's own
    rendering, independent of worker_argv's)."""
    if not action.option_strings:
        return [str(value)], []
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [LLAMA], [flag] if value else []
    return [LLAMA], [word for v in (value if isinstance(value, list) else [value]) for word in (flag, str(v))]


def _sbatch_node_argv(script: Path, tmp_path: Path) -> list[str]:
    """Run the sbatch script's node command with a stand-in interpreter; the argv after `-m neurontrain run`."""
    lines = script.read_text().split('exec "$PYTHON"', 1)[1].splitlines()
    end = next(i for i, line in enumerate(lines) if not line.endswith("\\"))
    command = 'exec "$PYTHON"' + "\n".join(lines[: end + 1])
    recorder = tmp_path / "record-python"
    recorder.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    recorder.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"],
        "PYTHON": str(recorder),
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NODEID": "0",
        "MASTER_ADDR": "127.0.0.1",
    }
    done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    argv = json.loads(done.stdout)
    assert argv[:3] == ["-m", "neurontrain", "run"], argv
    return argv[3:]


def _slurm_argv(capsys, tmp_path: Path, recipe: list[str], words: list[str]) -> list[str]:
    out = [] if "--output-dir" in words else ["--output-dir", str(tmp_path / "slurm")]
    code = main(
        [
            "submit",
            "slurm",
            *recipe,
            "--nodes",
            "1",
            "--instance-type",
            "trn1.2xlarge",
            "--job-name",
            "fwd",
            *out,
            *words,
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return _sbatch_node_argv(Path(json.loads(captured.out)["script"]), tmp_path)


def _sagemaker_argv(capsys, tmp_path: Path, recipe: list[str], words: list[str]) -> tuple[list[str], Path]:
    """`submit sagemaker --dry-run`, its hyperparameters decoded as the training toolkit decodes them, then the
    entry with a recording runner: (the argv after `run`, the entry's recipe file)."""
    code = main(
        [
            "submit",
            "sagemaker",
            *recipe,
            "--role",
            ROLE,
            "--output",
            "s3://my-bucket/jobs",
            "--region",
            "us-west-2",
            "--instance-type",
            "ml.trn1.2xlarge",
            "--job-name",
            "fwd",
            "--dry-run",
            *words,
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    hps = {key: json.loads(value) for key, value in json.loads(captured.out)["HyperParameters"].items()}
    base, seen = tmp_path / "ml", []
    env = {
        "SM_HPS": json.dumps(hps),
        "SM_HOSTS": '["algo-1"]',
        "SM_CURRENT_HOST": "algo-1",
        "SAGEMAKER_BASE_DIR": str(base),
        "SM_MODEL_DIR": str(base / "model"),
        "NEURONTRAIN_NPROC_PER_NODE": "2",
    }
    assert sagemaker_entry(env, lambda argv: seen.append(argv) or 0) == 0
    assert seen[0][0] == "run"
    return seen[0][1:], base / "checkpoints" / "sagemaker-recipe.json"


def _batch_argv(capsys, tmp_path: Path, recipe: list[str], words: list[str]) -> tuple[list[str], Path]:
    """`submit batch --dry-run`, then the node entry's command line from the node overrides' run arguments and
    the shipped recipe: (the argv after `run`, the node's recipe file)."""
    common = ["--job-queue", "q", "--nodes", "1", "--instance-type", "trn1.2xlarge", "--region", "us-west-2"]
    code = main(["submit", "batch", *recipe, *common, "--checkpoint-dir", "s3://my-bucket/jobs", "--dry-run", *words])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    requests = json.loads(captured.out)
    overrides = requests["submit_job"]["nodeOverrides"]["nodePropertyOverrides"][0]["containerOverrides"]
    env = {e["name"]: e["value"] for e in overrides["environment"]}
    recipe_file = tmp_path / "batch" / "recipe.json"
    recipe_file.parent.mkdir(parents=True, exist_ok=True)
    recipe_file.write_text(json.dumps(requests["recipe"]))
    node = BatchNode(index=0, main_index=0, nodes=1, attempt=1, job_id="j", main_address=None)
    argv = batch_node_argv(node, recipe_file, tmp_path / "batch" / "run", "10.0.0.1", 29500, 2,
                           json.loads(env["NEURONTRAIN_RUN_ARGS"]))  # fmt: skip
    assert argv[0] == "run"
    return argv[1:], recipe_file


def test_every_run_argument_is_a_worker_argument_or_launcher_only():
    workers, launcher = worker_dests(), launcher_only_dests()
    assert not workers & launcher
    undeclared = sorted(set(ACTIONS) - workers - launcher)
    assert not undeclared, f"run arguments neither passed to the workers nor declared launcher-only: {undeclared}"


@pytest.mark.parametrize("dest", sorted(ACTIONS))
def test_run_argument_reaches_every_worker_or_none(dest, tmp_path, capsys):
    action = ACTIONS[dest]
    value = _sample(action, tmp_path)
    args = RUN.parse_args([LLAMA])
    assert value != getattr(args, dest) or dest == "recipe"
    setattr(args, dest, value)
    argv = worker_argv(args)
    if dest in launcher_only_dests():
        assert argv == worker_argv(RUN.parse_args([LLAMA])), f"{dest} is launcher-only but reached the workers"
        return
    assert dest in worker_dests(), f"{dest}: declare it a worker argument or launcher-only"
    # torchrun's workers
    assert getattr(RUN.parse_args(argv), dest) == value, argv
    recipe, words = _submit_words(action, value)
    # the sbatch script's node command
    assert getattr(RUN.parse_args(_slurm_argv(capsys, tmp_path, recipe, words)), dest) == value
    # the SageMaker entry's command line; what the recipe carries is checked in the recipe it rebuilt
    entry_argv, recipe_file = _sagemaker_argv(capsys, tmp_path, recipe, [] if dest == "output_dir" else words)
    parsed = RUN.parse_args(entry_argv)
    if dest not in SAGEMAKER_CARRIED:
        assert getattr(parsed, dest) == value, entry_argv
    elif dest == "output_dir":
        assert parsed.output_dir == str(recipe_file.parent)  # the job's checkpoint directory, synced with S3
    else:
        overrides = value if dest == "overrides" else []
        assert parsed.recipe == str(recipe_file) and parsed.overrides == []
        assert load_recipe(recipe_file).model_dump() == load_recipe(LLAMA, overrides).model_dump()
    # the AWS Batch node entry's command line; the recipe (with --set and --backend) travels shipped
    node_argv, recipe_file = _batch_argv(capsys, tmp_path, recipe, [] if dest == "output_dir" else words)
    parsed = RUN.parse_args(node_argv)
    if dest not in BATCH_CARRIED:
        assert getattr(parsed, dest) == value, node_argv
    elif dest == "output_dir":
        assert parsed.output_dir == str(tmp_path / "batch" / "run")  # the node's own, mirrored to S3
    else:
        overrides = value if dest == "overrides" else [f"runtime.backend={value}"] if dest == "backend" else []
        assert parsed.recipe == str(recipe_file) and parsed.overrides == [] and parsed.backend is None
        assert load_recipe(recipe_file).model_dump() == load_recipe(LLAMA, overrides).model_dump()


def test_worker_argv_is_what_run_launches_through_torchrun(tmp_path):
    args = RUN.parse_args(
        [
            LLAMA,
            "-o",
            str(tmp_path),
            "--set",
            "train.max_steps=3",
            "--backend",
            "xla-cpu",
            "--no-preflight",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--dry-run",
        ]
    )
    argv = worker_argv(args)
    assert argv == [
        LLAMA,
        "--output-dir",
        str(tmp_path),
        "--set",
        "train.max_steps=3",
        "--backend",
        "xla-cpu",
        "--no-preflight",
    ]
