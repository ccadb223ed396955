"""`submit slurm` and `submit sagemaker` without a cluster: the sbatch script, the SageMaker request (botocore's
stubber and a local endpoint), the image table against the published list, the entry script's pieces, and the
one-line errors for bad instance types, regions and buckets. No torch: submit must not need it.

The tests here start processes; the in-process ones are in tests/unit/test_submit_pure.py."""

import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from conftest import RECIPES, REPO, cli_in_process, run_cli

LLAMA = str(RECIPES / "tiny-llama-clm.yaml")
ROLE = "arn:aws:iam::123456789012:role/Trainer"


def test_sbatch_script_static_rendezvous_neuron_env_and_node_settings(tmp_path, capsys):
    code, out, err = cli_in_process(
        capsys,
        "submit",
        "slurm",
        LLAMA,
        "--nodes",
        "4",
        "--job-name",
        "j1",
        "-o",
        str(tmp_path / "run dir"),
        "--partition",
        "trn1",
        "--time",
        "12:00:00",
        "--compile-cache",
        "s3://my-bucket/cache",
        "--set",
        "train.max_steps=7",
        "--set",
        "data.text_field=my text",
    )
    assert code == 0, err
    assert json.loads(out)["workers"] == 128
    script_path = tmp_path / "run dir" / "j1.sbatch"
    script = script_path.read_text()
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --partition=trn1",
        "#SBATCH --time=12:00:00",
        f'#SBATCH --output="{tmp_path / "run dir"}/slurm-%j.out"',
        "export FI_PROVIDER=efa",
        "export FI_EFA_USE_DEVICE_RDMA=1",
        "export FI_EFA_FORK_SAFE=1",
        'export NEURON_RT_ROOT_COMM_ID="$MASTER_ADDR:41000"',
        "--nproc-per-node=32",
        '--nnodes="$SLURM_JOB_NUM_NODES" --node-rank="$SLURM_NODEID"',
        '--master-addr="$MASTER_ADDR" --master-port=29500',
        "--set train.max_steps=7",
        "--set 'data.text_field=my text'",
        "--set runtime.compile_cache=s3://my-bucket/cache",
        "export NEURONTRAIN_CACHE_DIR=/var/tmp/neurontrain-cache",
        "ulimit -n 65535",
        "net.ipv4.ip_local_reserved_ports",
        '--cpus-per-task="$SLURM_CPUS_ON_NODE"',
        "node-%n.log",
    ):
        assert line in script, line
    assert f"--output-dir '{tmp_path / 'run dir'}'" in script
    assert "NEURON_COMPILE_CACHE_URL" not in script and "rdzv-endpoint" not in script
    assert subprocess.run(["bash", "-n", str(script_path)]).returncode == 0


def test_sbatch_node_function_passes_every_value_through_quoting(tmp_path, capsys):
    """Run the script's own node function with a stand-in interpreter that records its argv."""
    odd = tmp_path / "it's a dir"
    assert (
        cli_in_process(
            capsys,
            "submit",
            "slurm",
            LLAMA,
            "--nodes",
            "2",
            "--nproc-per-node",
            "2",
            "-o",
            str(odd),
            "--job-name",
            "q",
            "--set",
            "data.text_field=a b; echo $HOME",
            "--node-cache-dir",
            str(tmp_path / "cache"),
        )[0]
        == 0
    )
    recorder = tmp_path / "python"
    recorder.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    recorder.chmod(0o755)
    script = (odd / "q.sbatch").read_text()
    function = script[script.index("neurontrain_node() {") : script.index("export -f neurontrain_node")]
    env = {
        "PATH": os.environ["PATH"],
        "PYTHON": str(recorder),
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "MASTER_ADDR": "10.0.0.7",
        "NEURONTRAIN_CACHE_DIR": str(tmp_path / "cache"),
    }
    reserved = Path("/proc/sys/net/ipv4/ip_local_reserved_ports")
    before = reserved.read_text() if reserved.exists() else None
    try:
        done = subprocess.run(["bash", "-c", function + "\nneurontrain_node"], env=env, capture_output=True, text=True)
    finally:
        if before is not None and os.geteuid() == 0:
            reserved.write_text(before.strip() or "\n")  # leave the host as it was
    assert done.returncode == 0, done.stderr
    argv = json.loads(done.stdout)
    assert argv[:6] == ["-m", "neurontrain", "run", str(RECIPES / "tiny-llama-clm.yaml"), "--output-dir", str(odd)]
    assert "--node-rank=1" in argv and "--master-addr=10.0.0.7" in argv and "--nnodes=2" in argv
    assert argv[argv.index("--set") + 1] == "data.text_field=a b; echo $HOME"
    assert (tmp_path / "cache").is_dir()


def test_submit_needs_neither_torch_nor_torch_xla(tmp_path):
    """The submit code paths run in a fresh interpreter; torch and torch-xla stay unimported."""
    code = (
        "import sys\nfrom neurontrain.cli import main\n"
        f"assert main(['submit', 'slurm', {LLAMA!r}, '--nodes', '2', '-o', {str(tmp_path)!r}]) == 0\n"
        f"assert main(['submit', 'sagemaker', {LLAMA!r}, '--role', {ROLE!r}, '--output', 's3://b-1/x', "
        "'--region', 'us-east-1', '--dry-run']) == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_xla', 'transformers')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_submit_sagemaker_against_a_local_endpoint(s3_bucket):
    """The CLI uploads the source and creates the job on the local moto server (S3 and SageMaker APIs)."""
    import boto3

    bucket, s3 = s3_bucket
    result = run_cli(
        "submit",
        "sagemaker",
        str(RECIPES / "tiny-bert-classification.yaml"),
        "--role",
        ROLE,
        "--instance-count",
        "2",
        "--output",
        f"s3://{bucket}/jobs",
        "--job-name",
        "bert-7",
        "--region",
        "us-east-1",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["checkpoints"] == f"s3://{bucket}/jobs/bert-7/checkpoints"
    body = s3.get_object(Bucket=bucket, Key="jobs/bert-7/source/sourcedir.tar.gz")["Body"].read()
    tar = tarfile.open(fileobj=io.BytesIO(body))
    names = tar.getnames()
    assert "neurontrain_sagemaker_entry.py" in names and "neurontrain/launch/sagemaker_entry.py" in names
    requirements = tar.extractfile("requirements.txt").read().decode()
    assert "transformers" in requirements and not re.search(r"^torch", requirements, re.M)
    job = boto3.client("sagemaker", region_name="us-east-1").describe_training_job(TrainingJobName="bert-7")
    assert job["HyperParameters"]["recipe.name"] == '"tiny-bert-classification"'
    assert job["ResourceConfig"]["InstanceType"] == "ml.trn1.32xlarge"
