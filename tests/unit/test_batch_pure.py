"""`submit batch` without AWS: the requests pass botocore's own validator on Batch's service model, the toolkit's
range checks (Batch's model types the fields but checks no range) refuse in one line, the queue rules, the job
definition's reuse by content, the node entry's reading of Batch's variables, and the S3 checkpoint listing."""

import json

import botocore.session
import pytest
from botocore.validate import ParamValidator
from conftest import RECIPES, cli_in_process

from neurontrain.errors import UsageError
from neurontrain.launch.batch import (
    DEFINITION_TAG,
    BatchJob,
    check_queue,
    job_definition_request,
    reusable_definition,
)
from neurontrain.launch.batch_checkpoints import remote_steps
from neurontrain.launch.batch_entry import BatchNode, init_from_url, node_environment, run_argv
from neurontrain.launch.instances import ec2_instance

LLAMA = str(RECIPES / "tiny-llama-clm.yaml")
BASE = ["submit", "batch", LLAMA, "--job-queue", "q1", "--nodes", "2", "--checkpoint-dir", "s3://my-bucket/jobs",
        "--region", "us-east-1"]  # fmt: skip


def _job(**changes) -> BatchJob:
    values = dict(
        job_name="j1", job_queue="q1", nodes=2, instance=ec2_instance("trn1.32xlarge"), image="img:1",
        checkpoint_dir="s3://my-bucket/jobs",
    )  # fmt: skip
    return BatchJob(**{**values, **changes})


def _validate(operation: str, params: dict) -> None:
    model = botocore.session.get_session().get_service_model("batch")
    report = ParamValidator().validate(params, model.operation_model(operation).input_shape)
    assert not report.has_errors(), report.generate_report()


def test_dry_run_requests_pass_botocores_validator_and_carry_the_job(capsys):
    code, out, err = cli_in_process(capsys, *BASE, "--set", "train.max_steps=7", "--attempts", "4", "--timeout",
                                    "3600", "--dry-run")  # fmt: skip
    assert code == 0, err
    requests = json.loads(out)
    definition, submit = requests["register_job_definition"], requests["submit_job"]
    _validate("RegisterJobDefinition", definition)
    _validate("SubmitJob", submit)
    node = definition["nodeProperties"]["nodeRangeProperties"][0]["container"]
    paths = [d["hostPath"] for d in node["linuxParameters"]["devices"]]
    assert paths == [f"/dev/neuron{i}" for i in range(16)] + [f"/dev/infiniband/uverbs{i}" for i in range(8)]
    assert {"name": "memlock", "softLimit": -1, "hardLimit": -1} in node["ulimits"]
    assert node["linuxParameters"]["sharedMemorySize"] > 0 and node["instanceType"] == "trn1.32xlarge"
    env = {e["name"]: e["value"] for e in node["environment"]}
    assert env["FI_PROVIDER"] == "efa" and env["NEURONTRAIN_NPROC_PER_NODE"] == "32"
    retry = definition["retryStrategy"]
    assert retry["attempts"] == 4 and definition["timeout"] == {"attemptDurationSeconds": 3600}
    assert {"onExitCode": "2", "action": "EXIT"} in retry["evaluateOnExit"]
    assert {"onExitCode": "3", "action": "RETRY"} in retry["evaluateOnExit"]
    assert len(retry["evaluateOnExit"]) <= 5
    overrides = submit["nodeOverrides"]["nodePropertyOverrides"][0]["containerOverrides"]["environment"]
    job_env = {e["name"]: e["value"] for e in overrides}
    assert job_env["NEURONTRAIN_CHECKPOINTS"] == "s3://my-bucket/jobs"
    assert job_env["NEURONTRAIN_RECIPE_URL"].startswith("s3://my-bucket/jobs/recipes/")
    assert json.loads(job_env["NEURONTRAIN_RUN_ARGS"]) == []  # --set travels in the shipped recipe


def test_run_flags_reach_the_nodes(capsys):
    code, out, err = cli_in_process(capsys, *BASE, "--no-preflight", "--init-from", "/fsx/prev/model", "--dry-run")
    assert code == 0, err
    overrides = json.loads(out)["submit_job"]["nodeOverrides"]["nodePropertyOverrides"][0]["containerOverrides"]
    job_env = {e["name"]: e["value"] for e in overrides["environment"]}
    assert json.loads(job_env["NEURONTRAIN_RUN_ARGS"]) == ["--no-preflight", "--init-from", "/fsx/prev/model"]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--attempts", "11"], "1 to 10 attempts"),
        (["--attempts", "0"], "1 to 10 attempts"),
        (["--priority", "10000"], "0 to 9999"),
        (["--timeout", "59"], "at least 60 seconds"),
        (["--share-identifier", "team-a"], "letters, digits and '_'"),
        (["--job-name", "-bad"], "--job-name"),
        (["--memory", "9999999"], "--memory"),
    ],
)
def test_out_of_range_values_are_one_line_errors(capsys, flags, says):
    code, _, err = cli_in_process(capsys, *BASE, *flags, "--dry-run")
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("neurontrain: error:") and says in lines[-1], err
    assert "Traceback" not in err


def test_sharded_checkpoints_across_nodes_are_refused(capsys):
    code, _, err = cli_in_process(capsys, *BASE, "--set", "train.zero1=true", "--dry-run")
    assert code == 2 and "share no file system" in err.strip().splitlines()[-1]


def test_queue_rules():
    fair = {"jobQueueName": "fair", "state": "ENABLED", "schedulingPolicyArn": "arn:x"}
    fifo = {"jobQueueName": "fifo", "state": "ENABLED"}
    ec2 = [{"type": "MANAGED", "computeResources": {"type": "EC2"}}]
    check_queue(_job(share_identifier="teamA", priority=5), fair, ec2)
    check_queue(_job(), fifo, ec2)
    for job, queue, says in (
        (_job(), fair, "pass --share-identifier"),
        (_job(share_identifier="teamA"), fifo, "refuses --share-identifier"),
        (_job(priority=3), fifo, "first-in first-out"),
        (_job(), None, "no such job queue"),
        (_job(), {**fifo, "state": "DISABLED"}, "takes no jobs"),
    ):
        with pytest.raises(UsageError, match=says):
            check_queue(job, queue, ec2)
    spot = [{"type": "MANAGED", "computeResources": {"type": "SPOT"}}, {"type": "UNMANAGED"}]
    with pytest.raises(UsageError, match="do not run on Spot"):
        check_queue(_job(), fifo, spot)


def test_job_definition_is_reused_only_with_the_same_content():
    request = job_definition_request(_job())
    tag = request["tags"][DEFINITION_TAG]
    same = {"revision": 3, "status": "ACTIVE", "jobDefinitionArn": "arn:d:3", "tags": {DEFINITION_TAG: tag}}
    older = {**same, "revision": 1, "jobDefinitionArn": "arn:d:1"}
    other = {**same, "revision": 4, "jobDefinitionArn": "arn:d:4", "tags": {DEFINITION_TAG: "0" * 64}}
    assert reusable_definition(request, [older, same, other]) == "arn:d:3"
    assert reusable_definition(job_definition_request(_job(attempts=5)), [older, same, other]) is None
    assert job_definition_request(_job(nodes=4))["tags"][DEFINITION_TAG] != tag


def test_node_reads_batchs_variables():
    env = {"AWS_BATCH_JOB_NODE_INDEX": "0", "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0", "AWS_BATCH_JOB_NUM_NODES": "2",
           "AWS_BATCH_JOB_ATTEMPT": "2", "AWS_BATCH_JOB_ID": "abc-123#0"}  # fmt: skip
    main = BatchNode.from_env(env)
    assert main.is_main and main.job_id == "abc-123" and main.attempt == 2 and main.node_rank == 0
    child = BatchNode.from_env({**env, "AWS_BATCH_JOB_NODE_INDEX": "1", "AWS_BATCH_JOB_ID": "abc-123#1",
                                "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS": "10.0.0.5"})  # fmt: skip
    assert not child.is_main and child.node_rank == 1 and child.job_id == "abc-123"
    argv = run_argv(child, "r.json", "run", child.main_address, 29500, 32, ["--no-preflight"])
    assert argv[argv.index("--node-rank") + 1] == "1" and argv[argv.index("--master-addr") + 1] == "10.0.0.5"
    with pytest.raises(UsageError, match="MAIN_NODE_PRIVATE_IPV4_ADDRESS"):
        BatchNode.from_env({**env, "AWS_BATCH_JOB_NODE_INDEX": "1"})
    with pytest.raises(UsageError, match="AWS_BATCH_JOB_NUM_NODES"):
        BatchNode.from_env({k: v for k, v in env.items() if k != "AWS_BATCH_JOB_NUM_NODES"})
    neuron = node_environment(main, "10.0.0.5", {"NEURONTRAIN_INSTANCE_TYPE": "trn1.32xlarge"})
    assert neuron["NEURON_RT_ROOT_COMM_ID"] == "10.0.0.5:41000" and neuron["FI_EFA_USE_DEVICE_RDMA"] == "1"


def test_the_mirror_reads_the_trainers_checkpoint_layout(tmp_path):
    from neurontrain.launch import batch_checkpoints
    from neurontrain.loop import checkpoints

    assert batch_checkpoints.MARKER == checkpoints.MARKER
    assert batch_checkpoints.checkpoint_name(20) == checkpoints.checkpoint_name(20)
    for step, marked in ((4, True), (8, True), (12, False)):
        path = tmp_path / checkpoints.checkpoint_name(step)
        path.mkdir()
        (path / checkpoints.STATE_FILE).write_bytes(b"x")
        if marked:
            (path / checkpoints.MARKER).write_text(f"{step}\n")
    (tmp_path / ".step_00000016.partial").mkdir()
    assert batch_checkpoints.complete_checkpoints(tmp_path) == checkpoints.complete_checkpoints(tmp_path)


def test_only_checkpoints_with_their_marker_in_s3_count():
    keys = ["step_00000004/state.pt", "step_00000004/meta.json", "step_00000004/COMPLETE",
            "step_00000008/state.pt", "other/file"]  # fmt: skip
    assert remote_steps(keys) == {4: ["COMPLETE", "meta.json", "state.pt"]}


def test_init_from_s3_is_found_among_the_run_arguments():
    assert init_from_url(["--no-preflight", "--init-from", "s3://b/jobs/j0/model"]) == (2, "s3://b/jobs/j0/model")
    assert init_from_url(["--init-from", "/fsx/model"]) is None and init_from_url(["--init-from"]) is None
