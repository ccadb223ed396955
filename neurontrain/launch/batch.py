"""`neurontrain submit batch`: an AWS Batch multi-node parallel job on Trainium instances. Pure logic: the
requests (job definition, job submission), the checks Batch's API model does not make (ranges and names), and
what a job queue allows; the boto3 calls are in `launch/batch_submit.py`.

Every node of the job runs the same container: the Neuron training image, with a short bootstrap that fetches
this package's source (the same sourcedir.tar.gz `submit sagemaker` ships) from S3, installs its requirements
and starts the node entry (`launch/batch_entry.py`). The job definition holds what belongs to the instance type
(every Neuron device and EFA interface, the memlock limit, shared memory, the retry strategy) and is reused while
its content is the same (a tag carries the content's hash); the job's own settings (recipe, `run`'s arguments,
where checkpoints go) travel as node overrides of the submission.

Sources: the AWS Batch user guide (multi-node parallel jobs, retry strategies, fair-share scheduling) and the
Neuron samples for AWS Batch (devices /dev/neuron0..15 and /dev/infiniband/uverbs0..N, memlock -1).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from neurontrain.errors import UsageError
from neurontrain.launch.dlc import check_s3_url
from neurontrain.launch.instances import Trainium

DEFINITION_TAG = "neurontrain:definition-sha256"  # the content hash a reused job definition carries
NODE_CACHE_DIR = "/tmp/neurontrain-cache"
WORK_DIR = "/tmp/neurontrain-batch"  # node-local: the run directory; checkpoints are mirrored to S3
SOURCE_DIR = "/opt/neurontrain"  # where the bootstrap unpacks the shipped source in the container
MAX_ATTEMPTS = 10
MAX_PRIORITY = 9999
MIN_TIMEOUT = 60
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,127}")  # job and job definition names
_SHARE = re.compile(r"[A-Za-z0-9_]{1,255}")


@dataclass(frozen=True)
class BatchHardware:
    """What a Batch container on this instance type is given: devices, vCPUs, memory (MiB)."""

    neuron_devices: int
    efa_interfaces: int
    memory_mib: int  # what the job asks for: the instance's memory less what ECS and the OS keep


# EC2's instance type tables: trn1.2xlarge 1 device, no EFA, 32 GiB; trn1.32xlarge 16 devices, 8 EFA, 512 GiB;
# trn1n.32xlarge 16 devices, 16 EFA, 512 GiB; trn2.48xlarge 16 devices, 16 EFA, 2 TiB. The job asks for 90 %.
HARDWARE = {
    "trn1.2xlarge": BatchHardware(1, 0, 32 * 1024 * 9 // 10),
    "trn1.32xlarge": BatchHardware(16, 8, 512 * 1024 * 9 // 10),
    "trn1n.32xlarge": BatchHardware(16, 16, 512 * 1024 * 9 // 10),
    "trn2.48xlarge": BatchHardware(16, 16, 2048 * 1024 * 9 // 10),
}

# What Batch does after a node's container exits (first match wins; no match retries): bad input stops the job,
# a failed health check or a lost host retries it on new hosts; any other failure retries too (a killed worker,
# a runtime error), and the next attempt resumes from the newest checkpoint in S3.
EVALUATE_ON_EXIT = [
    {"onExitCode": "2", "action": "EXIT"},
    {"onExitCode": "3", "action": "RETRY"},
    {"onStatusReason": "Host EC2*", "action": "RETRY"},
    {"onReason": "CannotPullContainerError*", "action": "EXIT"},
]

# The container's command: fetch the source named by NEURONTRAIN_SOURCE, install its requirements (the image keeps
# its own torch and torch-xla builds), start the node entry.
BOOTSTRAP = f"""\
import io, os, subprocess, sys, tarfile
try:
    import boto3
except ImportError:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "boto3"])
    import boto3
bucket, _, key = os.environ["NEURONTRAIN_SOURCE"][len("s3://"):].partition("/")
body = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
tarfile.open(fileobj=io.BytesIO(body)).extractall("{SOURCE_DIR}")
subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-r", "{SOURCE_DIR}/requirements.txt"])
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in ("{SOURCE_DIR}", os.environ.get("PYTHONPATH")) if p)
sys.exit(subprocess.call([sys.executable, "-m", "neurontrain.launch.batch_entry"]))
"""


def check_name(value: str, flag: str) -> str:
    if not _NAME.fullmatch(value):
        raise UsageError(f"{flag} {value!r}: 1-128 letters, digits, '-' and '_', starting with a letter or digit")
    return value


@dataclass(frozen=True, kw_only=True)
class BatchJob:
    """One `submit batch`: a bad value is a one-line UsageError naming its flag (Batch's API model types these
    fields but checks none of their ranges)."""

    job_name: str
    job_queue: str
    nodes: int
    instance: Trainium
    image: str
    checkpoint_dir: str  # s3://bucket/prefix: source, recipe, and <job id>/ (checkpoints, model, summary)
    definition_name: str = "neurontrain"
    attempts: int = 3
    timeout: int | None = None  # seconds an attempt may run
    share_identifier: str | None = None
    priority: int | None = None
    job_role_arn: str | None = None
    nproc_per_node: int | None = None
    memory_mib: int | None = None
    shared_memory_mib: int | None = None
    master_port: int = 29500
    environment: dict[str, str] = field(default_factory=dict)

    @property
    def hardware(self) -> BatchHardware:
        return HARDWARE[self.instance.name]

    @property
    def workers_per_node(self) -> int:
        return self.nproc_per_node or self.instance.workers

    def __post_init__(self) -> None:
        check_name(self.job_name, "--job-name")
        check_name(self.definition_name, "--job-definition-name")
        if not self.job_queue.strip():
            raise UsageError("--job-queue must name a job queue (its name or ARN)")
        if self.nodes < 1 or self.workers_per_node < 1:
            raise UsageError("--nodes and --nproc-per-node must be at least 1")
        if not 1 <= self.attempts <= MAX_ATTEMPTS:
            raise UsageError(f"--attempts {self.attempts}: AWS Batch allows 1 to {MAX_ATTEMPTS} attempts")
        if self.timeout is not None and self.timeout < MIN_TIMEOUT:
            raise UsageError(f"--timeout {self.timeout}: AWS Batch needs at least {MIN_TIMEOUT} seconds an attempt")
        if self.priority is not None and not 0 <= self.priority <= MAX_PRIORITY:
            raise UsageError(
                f"--priority {self.priority}: AWS Batch takes a scheduling priority of 0 to {MAX_PRIORITY}"
            )
        if self.share_identifier is not None and not _SHARE.fullmatch(self.share_identifier):
            raise UsageError(
                f"--share-identifier {self.share_identifier!r}: 1-255 letters, digits and '_' (AWS Batch's rule)"
            )
        if self.job_role_arn is not None and not re.fullmatch(
            r"arn:aws[a-z\-]*:iam::\d{12}:role/[\w+=,.@/\-]+", self.job_role_arn
        ):
            raise UsageError(f"--job-role {self.job_role_arn!r} is not an IAM role ARN")
        memory = self.memory_mib if self.memory_mib is not None else self.hardware.memory_mib
        if not 4 <= memory <= self.hardware.memory_mib:
            raise UsageError(f"--memory {memory}: between 4 and {self.hardware.memory_mib} MiB on {self.instance.name}")
        if self.shared_memory_mib is not None and not 0 < self.shared_memory_mib <= memory:
            raise UsageError(f"--shared-memory {self.shared_memory_mib}: more than 0 and at most --memory MiB")
        if not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port {self.master_port} is not a TCP port")
        check_s3_url(self.checkpoint_dir, "--checkpoint-dir")

    def s3(self, *parts: str) -> str:
        return "/".join([self.checkpoint_dir.rstrip("/"), *parts])


def devices(job: BatchJob) -> list[dict]:
    """Every Neuron device and EFA interface of the instance type, mapped into the container."""
    paths = [f"/dev/neuron{i}" for i in range(job.hardware.neuron_devices)]
    paths += [f"/dev/infiniband/uverbs{i}" for i in range(job.hardware.efa_interfaces)]
    return [{"hostPath": p, "containerPath": p, "permissions": ["READ", "WRITE", "MKNOD"]} for p in paths]


def container(job: BatchJob) -> dict:
    memory = job.memory_mib or job.hardware.memory_mib
    env = {
        **job.instance.environment(job.nodes),
        "MALLOC_ARENA_MAX": "64",
        "NEURONTRAIN_INSTANCE_TYPE": job.instance.name,
        "NEURONTRAIN_NPROC_PER_NODE": str(job.workers_per_node),
        "NEURONTRAIN_MASTER_PORT": str(job.master_port),
        "NEURONTRAIN_CACHE_DIR": NODE_CACHE_DIR,
        "NEURONTRAIN_WORK_DIR": WORK_DIR,
        **job.environment,
    }
    spec = {
        "image": job.image,
        "command": ["python3", "-c", BOOTSTRAP],
        "instanceType": job.instance.name,
        "resourceRequirements": [
            {"type": "VCPU", "value": str(job.instance.vcpus)},
            {"type": "MEMORY", "value": str(memory)},
        ],
        "linuxParameters": {
            "devices": devices(job),
            "sharedMemorySize": job.shared_memory_mib or memory // 8,
        },
        "ulimits": [
            {"name": "memlock", "softLimit": -1, "hardLimit": -1},
            {"name": "nofile", "softLimit": 65535, "hardLimit": 65535},
        ],
        "environment": [{"name": k, "value": v} for k, v in sorted(env.items())],
    }
    if job.job_role_arn:
        spec["jobRoleArn"] = job.job_role_arn
    return spec


def job_definition_request(job: BatchJob) -> dict:
    """register_job_definition's parameters, tagged with the hash of their own content."""
    request = {
        "jobDefinitionName": job.definition_name,
        "type": "multinode",
        "nodeProperties": {
            "numNodes": job.nodes,
            "mainNode": 0,
            "nodeRangeProperties": [{"targetNodes": "0:", "container": container(job)}],
        },
        "retryStrategy": {"attempts": job.attempts, "evaluateOnExit": EVALUATE_ON_EXIT},
        "propagateTags": True,
        "platformCapabilities": ["EC2"],
    }
    if job.timeout is not None:
        request["timeout"] = {"attemptDurationSeconds": job.timeout}
    request["tags"] = {DEFINITION_TAG: content_hash(request)}
    return request


def content_hash(request: dict) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()


def reusable_definition(request: dict, active: list[dict]) -> str | None:
    """The ARN of the newest ACTIVE revision (describe_job_definitions) whose content hash is this request's."""
    want = request["tags"][DEFINITION_TAG]
    same = [d for d in active if (d.get("tags") or {}).get(DEFINITION_TAG) == want and d.get("status") == "ACTIVE"]
    return max(same, key=lambda d: d["revision"])["jobDefinitionArn"] if same else None


def submit_job_request(job: BatchJob, definition: str, job_env: dict[str, str]) -> dict:
    """submit_job's parameters: job_env (recipe, `run`'s arguments, source) on every node."""
    request: dict = {
        "jobName": job.job_name,
        "jobQueue": job.job_queue,
        "jobDefinition": definition,
        "nodeOverrides": {
            "nodePropertyOverrides": [
                {
                    "targetNodes": "0:",
                    "containerOverrides": {
                        "environment": [{"name": k, "value": v} for k, v in sorted(job_env.items())]
                    },
                }
            ]
        },
        "propagateTags": True,
        "tags": {"neurontrain:job": job.job_name},
    }
    if job.share_identifier is not None:
        request["shareIdentifier"] = job.share_identifier
    if job.priority is not None:
        request["schedulingPriorityOverride"] = job.priority
    return request


def check_queue(job: BatchJob, queue: dict | None, environments: list[dict]) -> None:
    """What the queue (describe_job_queues) and its compute environments allow this job."""
    if queue is None:
        raise UsageError(f"--job-queue {job.job_queue}: no such job queue in this region")
    name = queue.get("jobQueueName", job.job_queue)
    if queue.get("state") != "ENABLED":
        raise UsageError(f"job queue {name} is {queue.get('state')}: it takes no jobs")
    fair_share = bool(queue.get("schedulingPolicyArn"))
    if fair_share and job.share_identifier is None:
        raise UsageError(f"job queue {name} has a fair-share scheduling policy: pass --share-identifier")
    if not fair_share and job.share_identifier is not None:
        raise UsageError(f"job queue {name} is first-in first-out: it refuses --share-identifier")
    if not fair_share and job.priority is not None:
        raise UsageError(f"--priority orders jobs of a fair-share queue; job queue {name} is first-in first-out")
    usable = [
        env
        for env in environments
        if env.get("type") == "MANAGED" and (env.get("computeResources") or {}).get("type") == "EC2"
    ]
    if environments and not usable:
        kinds = sorted({f"{e.get('type')}/{(e.get('computeResources') or {}).get('type', '-')}" for e in environments})
        raise UsageError(
            f"job queue {name} has no managed EC2 compute environment ({', '.join(kinds)}): multi-node jobs do "
            "not run on Spot, Fargate or unmanaged ones"
        )


def log_hint(job_id: str, region: str) -> str:
    return (
        f"aws batch describe-jobs --region {region} --jobs {job_id}#0 --query 'jobs[0].container.logStreamName' "
        f"(then aws logs tail /aws/batch/job --region {region} --follow --log-stream-names STREAM)"
    )
