"""Scale-out logic without workers: topology -> torchrun flags, global batch arithmetic, per-worker rows, the
data-parallel plan, the sbatch script, and the SageMaker request (botocore's stubber and a local endpoint)."""

import io
import json
import subprocess
import tarfile

import pytest

from conftest import RECIPES, run_cli
from neurontrain.data.collate import Collator
from neurontrain.data.plan import PlannedBatch
from neurontrain.errors import UsageError
from neurontrain.launch.topology import Topology, resolve_grad_accum, torchrun_args, worker_rows


def test_torchrun_args_single_node_is_standalone():
    args = torchrun_args(Topology(nproc_per_node=2, max_restarts=1).validate())
    assert args == ["--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1"]


def test_torchrun_args_multi_node_static_and_c10d():
    static = torchrun_args(Topology(4, 2, 1, "10.0.0.5", 29400, 0, rdzv_timeout=60).validate())
    assert "--rdzv-backend=static" in static and "--node-rank=1" in static and "--master-addr=10.0.0.5" in static
    assert "--master-port=29400" in static and "--rdzv-conf=timeout=60" in static and "--nnodes=2" in static
    c10d = torchrun_args(Topology(32, 4, rdzv_endpoint="head:29500", rdzv_id="77", max_restarts=2).validate())
    assert "--rdzv-backend=c10d" in c10d and "--rdzv-endpoint=head:29500" in c10d and "--rdzv-id=77" in c10d
    # torchrun's own parser accepts what we build
    from torch.distributed import run as torchrun

    parsed = torchrun.parse_args(c10d + ["--module", "neurontrain", "run", "r.yaml"])
    assert parsed.nproc_per_node == "32" and parsed.max_restarts == 2 and parsed.training_script == "neurontrain"


@pytest.mark.parametrize("topology, message", [
    (Topology(nproc_per_node=0), "--nproc-per-node"),
    (Topology(nnodes=2, node_rank=2), "--node-rank"),
    (Topology(max_restarts=-1), "--max-restarts"),
    (Topology(master_port=70000), "--master-port"),
    (Topology(master_addr="a b"), "--master-addr"),
    (Topology(nnodes=2, rdzv_endpoint="head"), "HOST:PORT"),
    (Topology(nnodes=2, rdzv_endpoint="head:1"), "--rdzv-id"),
])
def test_bad_topologies(topology, message):
    with pytest.raises(UsageError, match=message):
        topology.validate()


def test_global_batch_arithmetic():
    assert resolve_grad_accum(8, 2, 1, None) == 1
    assert resolve_grad_accum(8, 2, 1, 64) == 4
    assert resolve_grad_accum(8, 2, 4, 64) == 4
    with pytest.raises(UsageError, match="not divisible by data.batch_size 8 x 2 workers = 16"):
        resolve_grad_accum(8, 2, 1, 24)
    with pytest.raises(UsageError, match="contradicts"):
        resolve_grad_accum(8, 2, 2, 64)


def test_worker_rows_partition_every_batch():
    indices = tuple(range(11))
    parts = [worker_rows(indices, r, 3) for r in range(3)]
    assert sorted(sum(parts, ())) == list(indices) and [len(p) for p in parts] == [4, 4, 3]


def test_collator_takes_its_rows_and_counts_loss_items():
    ids = [[5, 6, 7], [5, 6], [5, 6, 7, 8], [5]]
    batch = PlannedBatch(4, (0, 1, 2, 3))
    r0 = Collator(ids, None, "causal-lm", 2, 0, rank=0, world=2)(batch)
    r1 = Collator(ids, None, "causal-lm", 2, 0, rank=1, world=2)(batch)
    assert r0["input_ids"].tolist() == [[5, 6, 7, 0], [5, 6, 7, 8]]
    assert r1["input_ids"].tolist() == [[5, 6, 0, 0], [5, 0, 0, 0]]
    assert (r0["loss_items"], r1["loss_items"]) == (2 + 3, 1 + 0)  # next-token labels per row: length - 1
    assert r0["real_tokens"] + r1["real_tokens"] == 10
    cls = Collator(ids, [1, 0, 1, 0], "sequence-classification", 2, 0, rank=1, world=2)(PlannedBatch(4, (0, 1, 2)))
    assert cls["labels"].tolist() == [0, -100] and cls["loss_items"] == 1


def _plan(world: int, *overrides: str):
    from neurontrain.loop.planning import make_plan
    from neurontrain.recipe import load_recipe

    recipe = load_recipe(RECIPES / "tiny-llama-clm.yaml", ["data.buckets=[64,128]", *overrides])
    return make_plan(recipe, "xla-cpu", world=world)


def test_data_parallel_plan_uses_global_batches_and_splits_the_step():
    one, two = _plan(1, "data.batch_size=16"), _plan(2, "data.batch_size=8")
    assert two.planner.batch_size == 16 and one.planner.batch_size == 16
    assert [b.indices for b in one.planner.epoch(0)] == [b.indices for b in two.planner.epoch(0)]
    assert ("train", 64) in one.expected_graphs() and ("optimizer",) not in one.expected_graphs()
    assert ("train-micro", 64) in two.expected_graphs() and ("optimizer",) in two.expected_graphs()
    described = two.describe()
    assert (described["world_size"], described["per_worker_batch"], described["effective_batch"]) == (2, 8, 16)
    accum = _plan(2, "train.global_batch_size=64").describe()
    assert (accum["grad_accum"], accum["effective_batch"]) == (4, 64)
    from neurontrain.compile.discover import run_plan_id

    assert run_plan_id(two, "xla-cpu") != run_plan_id(_plan(1, "data.batch_size=8"), "xla-cpu")


def test_too_many_workers_for_the_data():
    with pytest.raises(UsageError, match="make no global batch of 8 x 4 workers = 32"):
        _plan(4, "data.train_samples=20")
    with pytest.raises(UsageError, match="4 workers but only 3 training samples"):
        _plan(4, "data.train_samples=3", "data.last_batch=pad")


# -- SLURM script --------------------------------------------------------------------------------------------
def test_sbatch_script_is_valid_bash_with_rendezvous_and_neuron_env(tmp_path):
    result = run_cli("submit", "slurm", str(RECIPES / "tiny-llama-clm.yaml"), "--nodes", "4", "--job-name", "j1",
                     "-o", str(tmp_path / "run"), "--partition", "trn1", "--time", "12:00:00",
                     "--compile-cache", "s3://bucket/cache", "--set", "train.max_steps=7", timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["workers"] == 128
    script = (tmp_path / "run" / "j1.sbatch").read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=trn1",
                 "#SBATCH --time=12:00:00", f"#SBATCH --output={tmp_path / 'run'}/slurm-%j.out",
                 "export FI_PROVIDER=efa", "export FI_EFA_USE_DEVICE_RDMA=1", "export NEURON_COMPILE_CACHE_URL=s3://bucket/cache",
                 'export NEURON_RT_ROOT_COMM_ID="${head_node}:41000"', "--nproc-per-node=32",
                 '--rdzv-endpoint="${head_node}:29500" --rdzv-id="$SLURM_JOB_ID"', "--set train.max_steps=7"):
        assert line in script, line
    assert subprocess.run(["bash", "-n", str(tmp_path / "run" / "j1.sbatch")]).returncode == 0


def test_submit_slurm_validates_before_queueing(tmp_path):
    result = run_cli("submit", "slurm", str(RECIPES / "tiny-llama-clm.yaml"), "--nodes", "2", "--nproc-per-node", "2",
                     "-o", str(tmp_path), "--set", "train.global_batch_size=24", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("neurontrain: error: train.global_batch_size 24")
    assert not list(tmp_path.glob("*.sbatch"))


# -- SageMaker ------------------------------------------------------------------------------------------------
def _sm_job(**kw):
    from neurontrain.launch.sagemaker import SageMakerJob
    from neurontrain.recipe import load_recipe

    recipe = load_recipe(RECIPES / "tiny-llama-clm.yaml").model_dump(mode="json")
    args = dict(recipe=recipe, role_arn="arn:aws:iam::123456789012:role/Trainer", instance_type="ml.trn1.32xlarge",
                instance_count=2, output="s3://bucket/jobs", region="us-west-2", job_name="tiny-1",
                compile_cache="s3://bucket/cache")
    args.update(kw)
    return SageMakerJob(**args).validate()


def test_sagemaker_request_is_valid_for_the_api():
    """botocore's stubber checks the request against SageMaker's API model; nothing leaves the process."""
    import boto3
    from botocore.stub import Stubber

    from neurontrain.launch.sagemaker import recipe_from_hyperparameters, training_job_request

    job = _sm_job()
    request = training_job_request(job)
    client = boto3.client("sagemaker", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stub:
        stub.add_response("create_training_job", {"TrainingJobArn": "arn:aws:sagemaker:us-west-2:1:training-job/tiny-1"},
                          request)
        assert client.create_training_job(**request)["TrainingJobArn"].endswith("tiny-1")
    hp = request["HyperParameters"]
    assert hp["sagemaker_torch_distributed_enabled"] == "true"
    assert json.loads(hp["sagemaker_program"]) == "neurontrain_sagemaker_entry.py"
    assert recipe_from_hyperparameters(hp) == job.recipe  # the recipe travels whole
    assert request["AlgorithmSpecification"]["TrainingImage"].startswith(
        "763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training-neuronx:")
    assert request["CheckpointConfig"] == {"S3Uri": "s3://bucket/jobs/tiny-1/checkpoints", "LocalPath": "/opt/ml/checkpoints"}
    assert request["Environment"]["NEURON_COMPILE_CACHE_URL"] == "s3://bucket/cache"
    assert request["ResourceConfig"]["InstanceCount"] == 2


@pytest.mark.parametrize("kw, message", [
    ({"role_arn": "Trainer"}, "IAM role ARN"), ({"output": "bucket/x"}, "s3://"),
    ({"instance_type": "trn1.32xlarge"}, "SageMaker type"), ({"job_name": "bad_name"}, "job name"),
])
def test_sagemaker_bad_input(kw, message):
    with pytest.raises(UsageError, match=message):
        _sm_job(**kw)


def test_submit_sagemaker_against_a_local_endpoint(s3_bucket, tmp_path):
    """The CLI uploads the source and creates the job on the local moto server (S3 and SageMaker APIs)."""
    import boto3

    bucket, s3 = s3_bucket
    result = run_cli("submit", "sagemaker", str(RECIPES / "tiny-bert-classification.yaml"),
                     "--role", "arn:aws:iam::123456789012:role/Trainer", "--instance-count", "2",
                     "--output", f"s3://{bucket}/jobs", "--job-name", "bert-7", "--region", "us-east-1", timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["checkpoints"] == f"s3://{bucket}/jobs/bert-7/checkpoints"
    body = s3.get_object(Bucket=bucket, Key="jobs/bert-7/source/sourcedir.tar.gz")["Body"].read()
    names = tarfile.open(fileobj=io.BytesIO(body)).getnames()
    assert "neurontrain_sagemaker_entry.py" in names and "neurontrain/launch/run.py" in names
    sm = boto3.client("sagemaker", region_name="us-east-1")
    job = sm.describe_training_job(TrainingJobName="bert-7")
    assert job["HyperParameters"]["recipe.name"] == '"tiny-bert-classification"'
    assert job["ResourceConfig"]["InstanceType"] == "ml.trn1.32xlarge"
    bad = run_cli("submit", "sagemaker", str(RECIPES / "tiny-bert-classification.yaml"), "--role", "nope",
                  "--output", f"s3://{bucket}/jobs", "--region", "us-east-1", timeout=120)
    assert bad.returncode == 2 and "IAM role ARN" in bad.stderr and "Traceback" not in bad.stderr


def test_sagemaker_entry_rebuilds_the_recipe(tmp_path):
    """The entry script's recipe file, written from the hyperparameters, loads as the same recipe."""
    from neurontrain.launch.sagemaker import recipe_from_hyperparameters, training_job_request
    from neurontrain.recipe import load_recipe

    job = _sm_job()
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe_from_hyperparameters(training_job_request(job)["HyperParameters"])))
    assert load_recipe(path).fingerprint() == load_recipe(RECIPES / "tiny-llama-clm.yaml").fingerprint()
