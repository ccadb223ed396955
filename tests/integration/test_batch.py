"""`submit batch` against a local moto server (Batch and S3 on 127.0.0.1; boto3 validates every request with
botocore's validator before sending it), and one shared two-node scenario of the node entry on this machine:
two `batch_entry` processes with the variables AWS Batch sets (the main one without
AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS, the child 5 s later) train as a torchrun run of the same 2 workers
does; the main node's worker is SIGKILLed after a checkpoint reached S3, and attempt 2 in fresh local directories
resumes from S3 and ends bit-identical to the uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import RECIPES, REPO, _free_port, cli_in_process, read_metrics, run_cli, torchrun_worker_pid

pytestmark = pytest.mark.slow

LLAMA = str(RECIPES / "tiny-llama-clm.yaml")
STEPS = 16
SMALL = ["--backend", "eager"] + [
    word
    for setting in (f"train.max_steps={STEPS}", "train.log_every=1", "checkpoint.every=4", "checkpoint.keep=2",
                    "train.eval_at_end=false", "data.train_samples=400", "data.max_length=64", "data.buckets=[64]")
    for word in ("--set", setting)
]  # fmt: skip


def _batch_world(env: dict) -> None:
    """Batch without docker on the moto server; a managed EC2 compute environment and a fair-share and a FIFO
    queue on it."""
    import boto3

    url = env["AWS_ENDPOINT_URL"]
    config = json.dumps({"batch": {"use_docker": False}}).encode()
    request = urllib.request.Request(f"{url}/moto-api/config", data=config, method="POST")
    urllib.request.urlopen(request, timeout=10).read()
    ec2, iam, batch = (boto3.client(name, region_name="us-east-1") for name in ("ec2", "iam", "batch"))
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
    group = ec2.create_security_group(GroupName="trn", Description="trn", VpcId=vpc)["GroupId"]
    role = iam.create_role(RoleName="batch-service", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    profile = iam.create_instance_profile(InstanceProfileName="trn-node")["InstanceProfile"]["Arn"]
    resources = {"type": "EC2", "minvCpus": 0, "maxvCpus": 512, "instanceTypes": ["trn1.32xlarge"],
                 "subnets": [subnet], "securityGroupIds": [group], "instanceRole": profile}  # fmt: skip
    batch.create_compute_environment(computeEnvironmentName="trn-ce", type="MANAGED", state="ENABLED",
                                     computeResources=resources, serviceRole=role)  # fmt: skip
    share = {"shareDecaySeconds": 3600, "shareDistribution": [{"shareIdentifier": "search", "weightFactor": 1.0}]}
    policy = batch.create_scheduling_policy(name="fair", fairsharePolicy=share)["arn"]
    order = [{"order": 1, "computeEnvironment": "trn-ce"}]
    batch.create_job_queue(jobQueueName="fair", state="ENABLED", priority=1, schedulingPolicyArn=policy,
                           computeEnvironmentOrder=order)  # fmt: skip
    batch.create_job_queue(jobQueueName="fifo", state="ENABLED", priority=1, computeEnvironmentOrder=order)


def _node(env: dict, index: int, attempt: int, work: Path, log: Path, main_address: str | None) -> subprocess.Popen:
    node_env = {**env, "AWS_BATCH_JOB_NODE_INDEX": str(index), "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0",
                "AWS_BATCH_JOB_NUM_NODES": "2", "AWS_BATCH_JOB_ATTEMPT": str(attempt),
                "AWS_BATCH_JOB_ID": f"job-1#{index}", "NEURONTRAIN_WORK_DIR": str(work),
                "NEURONTRAIN_CACHE_DIR": str(work / "cache"), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    if main_address is not None:
        node_env["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"] = main_address
    return subprocess.Popen([sys.executable, "-m", "neurontrain.launch.batch_entry"], cwd=REPO, env=node_env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    """As Batch ends a job's other nodes when its main node exits."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def test_submit_batch_then_two_nodes_train_fail_and_resume_from_s3(s3_bucket, tmp_path, capsys):
    import boto3
    from safetensors.torch import load_file

    bucket, s3 = s3_bucket
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env = {**os.environ, **env, "AWS_DEFAULT_REGION": "us-east-1"}
    _batch_world(env)
    port = _free_port()
    job = [LLAMA, *SMALL, "--nodes", "2", "--nproc-per-node", "1", "--checkpoint-dir", f"s3://{bucket}/jobs",
           "--master-port", str(port), "--region", "us-east-1", "--job-name", "llama-1"]  # fmt: skip

    # -- submit: queue read, definition registered then reused, job submitted; the queue rules in one line
    code, _, err = cli_in_process(capsys, "submit", "batch", *job, "--job-queue", "fair")
    assert code == 2 and err.strip().splitlines()[-1] == (
        "neurontrain: error: job queue fair has a fair-share scheduling policy: pass --share-identifier"
    )
    fair = [*job, "--job-queue", "fair", "--share-identifier", "search", "--priority", "7"]
    first = cli_in_process(capsys, "submit", "batch", *fair)
    assert first[0] == 0, first[2]
    again = cli_in_process(capsys, "submit", "batch", *fair)
    assert again[0] == 0, again[2]
    one, two = json.loads(first[1]), json.loads(again[1])
    assert not one["job_definition_reused"] and two["job_definition_reused"]
    assert one["job_definition"] == two["job_definition"] and one["job_id"] != two["job_id"]
    assert one["checkpoints"] == f"s3://{bucket}/jobs/{one['job_id']}/checkpoints" and "aws logs" in one["logs"]
    jobs = boto3.client("batch", region_name="us-east-1").describe_jobs(jobs=[one["job_id"]])["jobs"]
    assert jobs[0]["jobName"] == "llama-1" and jobs[0]["jobDefinition"] == one["job_definition"]
    code, _, err = cli_in_process(capsys, "submit", "batch", *job, "--job-queue", "fifo", "--share-identifier", "x")
    assert code == 2 and "refuses --share-identifier" in err.strip().splitlines()[-1]

    # -- the nodes' environment: the job definition's and the submission's, as Batch gives them
    code, out, err = cli_in_process(capsys, "submit", "batch", *fair, "--dry-run")
    assert code == 0, err
    requests = json.loads(out)
    container = requests["register_job_definition"]["nodeProperties"]["nodeRangeProperties"][0]["container"]
    overrides = requests["submit_job"]["nodeOverrides"]["nodePropertyOverrides"][0]["containerOverrides"]
    node_env = {**env, **{e["name"]: e["value"] for e in container["environment"] + overrides["environment"]}}
    node_env["NEURONTRAIN_CHECKPOINT_PUSH_INTERVAL"] = "0.5"
    recipe = tmp_path / "recipe.json"
    recipe_key = node_env["NEURONTRAIN_RECIPE_URL"].removeprefix(f"s3://{bucket}/")
    recipe.write_bytes(s3.get_object(Bucket=bucket, Key=recipe_key)["Body"].read())  # what submit shipped

    # -- the uninterrupted run: torchrun of the same 2 workers
    ref = tmp_path / "ref"
    done = run_cli("run", str(recipe), "--nproc-per-node", "2", "-o", str(ref), env=env, timeout=400)
    assert done.returncode == 0, done.stderr
    expected = _losses(ref)
    assert sorted(expected) == list(range(1, STEPS + 1))

    # -- attempt 1: main node, the child 5 s later; main's worker SIGKILLed once a checkpoint is in S3
    main_work, child_work = tmp_path / "a1-main", tmp_path / "a1-child"
    main = _node(node_env, 0, 1, main_work, tmp_path / "a1-main.log", None)
    time.sleep(5)
    child = _node(node_env, 1, 1, child_work, tmp_path / "a1-child.log", "127.0.0.1")
    try:
        # killed at its first checkpoint (a local file: polling S3 is too slow to catch a quiet machine's run);
        # the checkpoints complete by then reach S3 from the push thread or the entry's last push
        marker = main_work / "run" / "checkpoints" / "step_00000004" / "COMPLETE"
        deadline = time.time() + 300
        while not marker.exists():
            assert main.poll() is None and time.time() < deadline, (tmp_path / "a1-main.log").read_text()[-3000:]
            time.sleep(0.02)
        os.kill(torchrun_worker_pid(main_work / "run", 0), signal.SIGKILL)
        assert main.wait(timeout=120) == 1, (tmp_path / "a1-main.log").read_text()[-3000:]
    finally:
        _stop(main)
        _stop(child)
    before = _losses(main_work / "run")
    assert before and max(before) < STEPS, "the run ended before the kill"
    assert before == {step: expected[step] for step in before}
    kept = sorted(k["Key"] for k in s3.list_objects_v2(Bucket=bucket, Prefix="jobs/job-1/")["Contents"])
    resumable = max(int(k.split("/")[3][5:]) for k in kept if k.endswith("/COMPLETE"))

    # -- attempt 2 on "new hosts": fresh local directories; it resumes from S3 and ends as the uninterrupted run
    main_work, child_work = tmp_path / "a2-main", tmp_path / "a2-child"
    main = _node(node_env, 0, 2, main_work, tmp_path / "a2-main.log", None)
    time.sleep(1)
    child = _node(node_env, 1, 2, child_work, tmp_path / "a2-child.log", "127.0.0.1")
    try:
        assert main.wait(timeout=400) == 0, (tmp_path / "a2-main.log").read_text()[-3000:]
        assert child.wait(timeout=60) == 0, (tmp_path / "a2-child.log").read_text()[-3000:]
    finally:
        _stop(main)
        _stop(child)
    log = (tmp_path / "a2-main.log").read_text()
    assert f"job job-1 attempt 2, node 0 of 2: resuming from step {resumable}" in log
    after = _losses(main_work / "run")
    assert sorted(after) == list(range(resumable + 1, STEPS + 1))
    assert after == {step: expected[step] for step in after}
    model, reference = (
        load_file(main_work / "run" / "model" / "model.safetensors"),
        load_file(ref / "model" / "model.safetensors"),
    )
    assert model.keys() == reference.keys() and all((model[k] == reference[k]).all() for k in model)
    published = {k["Key"] for k in s3.list_objects_v2(Bucket=bucket, Prefix="jobs/job-1/")["Contents"]}
    assert {"jobs/job-1/summary.json", "jobs/job-1/model/model.safetensors"} <= published
