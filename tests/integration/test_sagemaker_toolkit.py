"""The generated SageMaker job run through the real SageMaker training toolkit (`sagemaker-training`, the code
inside the training containers): the request's hyperparameters written as SageMaker writes them, a local
channel directory, the toolkit's own environment, entry-point install and process runner, into a temp /opt/ml."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RECIPES, read_json, run_cli

pytestmark = pytest.mark.slow


def _opt_ml(root: Path, request: dict, data: Path | None, source_dir: Path | None = None) -> dict:
    """Lay out /opt/ml as SageMaker does for this request: input/config/*.json, input/data/<channel>/; the
    source tarball `submit` uploads, saved where sagemaker_submit_directory points."""
    from neurontrain.launch.sagemaker import source_tarball

    config = root / "input" / "config"
    config.mkdir(parents=True)
    (root / "output").mkdir()  # SageMaker creates it; the toolkit writes its success or failure file there
    hps = dict(request["HyperParameters"])
    tarball = root / "sourcedir.tar.gz"
    tarball.write_bytes(source_tarball(source_dir))
    hps["sagemaker_submit_directory"] = json.dumps(str(tarball))  # a local tarball instead of the S3 object
    (config / "hyperparameters.json").write_text(json.dumps(hps))
    instance = request["ResourceConfig"]["InstanceType"]
    (config / "resourceconfig.json").write_text(
        json.dumps(
            {
                "current_host": "algo-1",
                "hosts": ["algo-1"],
                "current_instance_type": instance,
                "current_group_name": "homogeneousCluster",
                "network_interface_name": "eth0",
                "instance_groups": [
                    {"instance_group_name": "homogeneousCluster", "instance_type": instance, "hosts": ["algo-1"]}
                ],
            }
        )
    )
    channels = {
        c["ChannelName"]: {
            "TrainingInputMode": c["InputMode"],
            "S3DistributionType": "FullyReplicated",
            "RecordWrapperType": "None",
        }
        for c in request.get("InputDataConfig", [])
    }
    (config / "inputdataconfig.json").write_text(json.dumps(channels))
    for name in channels:  # SageMaker downloads each channel's objects into input/data/<channel>/
        (root / "input" / "data" / name).mkdir(parents=True)
        (root / "input" / "data" / name / data.name).write_bytes(data.read_bytes())
    return hps


def _train_in_toolkit(tmp_path: Path, request: dict, root: Path) -> tuple[subprocess.CompletedProcess, str]:
    env = {
        **request["Environment"],
        "SAGEMAKER_BASE_DIR": str(root),
        "NEURONTRAIN_CACHE_DIR": str(tmp_path / "cc"),
        "SM_STUDIO_LOCAL_MODE": "true",  # the toolkit's switch for hosts that do not resolve algo-N names
        "AWS_REGION": "us-west-2",
        "PYTHONUNBUFFERED": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", "from sagemaker_training import trainer; trainer.train()"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    return done, done.stdout + done.stderr


def test_entry_script_trains_inside_the_sagemaker_training_toolkit(tmp_path):
    import sagemaker_training  # noqa: F401  (a test dependency: fail, do not skip, when it is missing)

    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog {i % 7} " * 3}) + "\n"
            for i in range(200)
        )
    )
    result = run_cli(
        "submit",
        "sagemaker",
        str(RECIPES / "tiny-llama-clm.yaml"),
        "--role",
        "arn:aws:iam::123456789012:role/Trainer",
        "--output",
        "s3://neurontrain-jobs/runs",
        "--instance-type",
        "ml.trn1.2xlarge",
        "--region",
        "us-west-2",
        "--job-name",
        "tk-1",
        "--input",
        "train=s3://neurontrain-data/sets/train.jsonl",
        "--set",
        "data.source=json",
        "--set",
        "data.train_samples=null",
        "--set",
        "data.eval_samples=16",
        "--set",
        "train.max_steps=4",
        "--set",
        "train.log_every=1",
        "--set",
        "checkpoint.every=2",
        "--set",
        "data.buckets=[64,128]",
        "--set",
        "train.schedule.warmup_steps=1",
        "--dry-run",
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    request = json.loads(result.stdout)
    root = tmp_path / "opt" / "ml"
    _opt_ml(root, request, data)
    done, log = _train_in_toolkit(tmp_path, request, root)
    assert done.returncode == 0, log[-4000:]
    assert (root / "output" / "success").exists()
    # the final model where SageMaker uploads it from, the run's figures in the output data
    assert (root / "model" / "config.json").is_file() and list((root / "model").glob("*.safetensors"))
    summary = read_json(root / "output" / "data" / "summary.json")
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert (root / "checkpoints" / "checkpoints" / "step_00000004" / "COMPLETE").exists()
    # every metric the request defines is found in the job's log by SageMaker's own regexes
    for metric in request["AlgorithmSpecification"]["MetricDefinitions"]:
        values = [float(m.group(1)) for m in re.finditer(metric["Regex"], log)]
        assert values, metric["Name"]
    losses = [
        float(m.group(1)) for m in re.finditer(request["AlgorithmSpecification"]["MetricDefinitions"][0]["Regex"], log)
    ]
    assert len(losses) == 4 and losses[-1] == pytest.approx(summary["final_loss"])


def test_a_lightning_script_trains_data_parallel_inside_the_sagemaker_training_toolkit(tmp_path):
    """`submit sagemaker --lightning`: the script's folder travels in the job's source, the entry runs it as the
    instance's torchrun workers (2 on a trn1.2xlarge) in the checkpoint directory, which SageMaker syncs."""
    example = Path(__file__).resolve().parents[2] / "examples" / "lightning_tiny.py"
    result = run_cli(
        "submit", "sagemaker", "--lightning", f"{example} --max-steps 6 --output-dir runs/tk",
        "--role", "arn:aws:iam::123456789012:role/Trainer", "--output", "s3://neurontrain-jobs/runs",
        "--instance-type", "ml.trn1.2xlarge", "--region", "us-west-2", "--job-name", "tk-lightning", "--dry-run",
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    request = json.loads(result.stdout)
    assert "InputDataConfig" not in request and not any(k.startswith("recipe.") for k in request["HyperParameters"])
    root = tmp_path / "opt" / "ml"
    _opt_ml(root, request, None, example.parent)
    done, log = _train_in_toolkit(tmp_path, request, root)
    assert done.returncode == 0, log[-4000:]
    assert (root / "output" / "success").exists(), log[-4000:]
    run = root / "checkpoints" / "runs" / "tk"  # the script's relative --output-dir, under the synced directory
    summary = read_json(run / "summary.json")
    assert summary["world_size"] == 2 and summary["steps"] == 6 and summary["unexpected_graphs"] == 0
    assert list((run / "checkpoints").glob("*.ckpt"))
