"""`neurontrain submit sagemaker`: a SageMaker training job on Trainium instances through boto3.

The job runs the Neuron PyTorch training image. Its training toolkit starts the entry script once on every
instance (no `torch_distributed`: the entry script is the node's launcher) with the hyperparameters JSON-decoded;
the entry script rebuilds the recipe and runs `neurontrain run` as one torchrun agent per instance (static
rendezvous on the first host, node rank = the host's index), so it pulls the compile cache once per node, and
rank 0 and the Neuron root communicator are on the first host. The recipe travels as hyperparameters (one dotted
key per leaf, JSON values, as the SageMaker SDK encodes them); the entry script and this package travel in
sourcedir.tar.gz under --output. Data comes in through channels (--input NAME=s3://...), the model goes to
/opt/ml/model, checkpoints to /opt/ml/checkpoints (synced with S3, so a retried job resumes).
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path
from typing import Any

import neurontrain
from neurontrain.errors import UsageError
from neurontrain.launch.dlc import check_s3_url
from neurontrain.launch.instances import Trainium
from neurontrain.launch.sagemaker_groups import group_name, instance_groups

ENTRY_SCRIPT = "neurontrain_sagemaker_entry.py"
CHECKPOINT_DIR = "/opt/ml/checkpoints"
CHANNEL_ROOT = "/opt/ml/input/data"
NODE_CACHE_DIR = "/tmp/neurontrain-cache"  # node-local: not synced to S3 like /opt/ml/checkpoints
HP_PREFIX = "recipe."
RUN_ARGS_HP = "neurontrain_run_args"  # `run`'s worker arguments for the entry's command line (a JSON list)
LIGHTNING_HP = "neurontrain_lightning"  # a Lightning job's "SCRIPT ARGS", SCRIPT relative to its source folder
LIGHTNING_SOURCE = "lightning_source"  # where the script's folder goes in sourcedir.tar.gz
MAX_SOURCE_BYTES = 50 * 2**20  # a script's folder is code: data travels through channels
METRIC_PREFIX = "neurontrain metric:"  # the line the entry script prints for each metrics.jsonl record
_NUMBER = r"([0-9.eE+\-]+)"
METRICS = [  # SageMaker reads these from the job's log (regexes over each line)
    {"Name": "train:loss", "Regex": METRIC_PREFIX + r' .*"loss": ' + _NUMBER},
    {"Name": "train:lr", "Regex": METRIC_PREFIX + r' .*"lr": ' + _NUMBER},
    {"Name": "train:tokens_per_second", "Regex": METRIC_PREFIX + r' .*"tokens_per_second": ' + _NUMBER},
    {"Name": "eval:loss", "Regex": METRIC_PREFIX + r' .*"eval_loss": ' + _NUMBER},
    {"Name": "train:final_loss", "Regex": r'"final_loss": ' + _NUMBER},
]
_MAX_HYPERPARAMETERS, _MAX_VALUE = 100, 2500  # SageMaker's limits on HyperParameters
_NOT_RUNTIME_DEPS = {"torch", "torch-xla", "torch_xla"}  # the image has its own (Neuron) builds


@dataclass(frozen=True, kw_only=True)
class SageMakerJob:
    recipe: dict  # the validated recipe (overrides applied), as plain data
    role_arn: str
    instance: Trainium
    instance_count: int
    output: str  # s3://bucket/prefix: model, source and checkpoints go under it
    region: str
    job_name: str
    image: str  # training image URI
    max_run_seconds: int = 24 * 3600
    volume_gb: int = 512
    inputs: dict[str, str] = field(default_factory=dict)  # channel name -> s3:// URI
    max_retries: int = 0
    environment: dict[str, str] = field(default_factory=dict)
    run_args: list[str] = field(default_factory=list)  # `run`'s worker arguments the recipe does not carry
    lightning: str = ""  # a Lightning job: "SCRIPT ARGS" (SCRIPT relative to source_dir) instead of a recipe
    source_dir: str = ""  # a Lightning job: the local folder of its script, shipped in sourcedir.tar.gz
    data_channels: tuple[str, ...] = ()  # a heterogeneous job: the channels only its data group reads

    @property
    def heterogeneous(self) -> bool:
        return bool((self.recipe.get("cluster") or {}).get("groups"))

    def __post_init__(self) -> None:
        if not re.fullmatch(r"arn:aws[a-z\-]*:iam::\d{12}:role/[\w+=,.@/\-]+", self.role_arn):
            raise UsageError(f"--role {self.role_arn!r} is not an IAM role ARN (arn:aws:iam::123456789012:role/NAME)")
        check_s3_url(self.output, "--output")
        for name, uri in self.inputs.items():
            if not re.fullmatch(r"[A-Za-z0-9._\-]{1,64}", name):
                raise UsageError(f"--input channel name {name!r}: 1-64 letters, digits, '.', '_' and '-'")
            check_s3_url(uri, f"--input {name}")
        if self.instance_count < 1:
            raise UsageError("--instance-count must be at least 1")
        if self.max_run_seconds < 1 or self.volume_gb < 1:
            raise UsageError("--max-run and --volume-size must be positive")
        if not 0 <= self.max_retries <= 30:
            raise UsageError("--max-retries must be between 0 and 30 (SageMaker's limit)")
        if not re.fullmatch(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}", self.job_name):
            raise UsageError(f"job name {self.job_name!r}: 1-63 letters, digits and hyphens")

    def s3(self, *parts: str) -> str:
        return "/".join([self.output.rstrip("/"), *parts])


def parse_inputs(specs: list[str]) -> dict[str, str]:
    """--input NAME=s3://bucket/prefix (repeatable) -> {NAME: URI}."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, uri = spec.partition("=")
        if not sep or not name or not uri:
            raise UsageError(f"--input {spec!r}: expected NAME=s3://bucket/prefix, e.g. train=s3://my-bucket/data")
        if name in out:
            raise UsageError(f"--input {name} given twice")
        out[name] = uri
    return out


def channel_dir(name: str) -> str:
    return f"{CHANNEL_ROOT}/{name}"


def recipe_hyperparameters(recipe: dict) -> dict[str, str]:
    """Flatten a recipe to {"recipe.a.b": json value}; lists and empty mappings stay whole JSON values."""
    out: dict[str, str] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                if "." in str(key):
                    raise UsageError(f"recipe key {key!r} contains '.', which hyperparameter names use as separator")
                walk(value, f"{path}.{key}" if path else str(key))
        else:
            out[HP_PREFIX + path] = json.dumps(node)

    walk(recipe, "")
    return out


def job_hyperparameters(job: SageMakerJob) -> dict[str, str]:
    """The recipe's hyperparameters, the toolkit's own, and `run`'s worker arguments; within SageMaker's limits."""
    hps = recipe_hyperparameters(job.recipe) if not job.lightning else {LIGHTNING_HP: json.dumps(job.lightning)}
    hps.update(
        {
            "sagemaker_program": json.dumps(ENTRY_SCRIPT),
            "sagemaker_submit_directory": json.dumps(job.s3(job.job_name, "source", "sourcedir.tar.gz")),
            "sagemaker_region": json.dumps(job.region),
        }
    )
    if job.run_args:
        hps[RUN_ARGS_HP] = json.dumps(job.run_args)
    if len(hps) > _MAX_HYPERPARAMETERS:
        raise UsageError(
            f"the recipe has {len(hps)} hyperparameters with SageMaker's own; the limit is "
            f"{_MAX_HYPERPARAMETERS} (move model.config into a pretrained config directory)"
        )
    for key, value in hps.items():
        if len(value) > _MAX_VALUE or len(key) > 256:
            raise UsageError(f"hyperparameter {key} is longer than SageMaker allows ({_MAX_VALUE} characters)")
    return hps


def training_job_request(job: SageMakerJob) -> dict:
    """The create_training_job parameters (pure)."""
    env = {
        "NEURONTRAIN_NPROC_PER_NODE": str(job.instance.workers),
        "NEURONTRAIN_CACHE_DIR": NODE_CACHE_DIR,
        **job.instance.environment(job.instance_count),
        # Ray's token auth needs one token on every host; the job's hosts talk over its own cluster network, so
        # the Ray cluster of a heterogeneous job runs without (docs/ray.md)
        **({"RAY_AUTH_MODE": "disabled"} if job.heterogeneous else {}),
        **job.environment,
    }
    request = {
        "TrainingJobName": job.job_name,
        "AlgorithmSpecification": {
            "TrainingImage": job.image,
            "TrainingInputMode": "File",
            "EnableSageMakerMetricsTimeSeries": True,
            "MetricDefinitions": METRICS if not job.lightning else [],  # a script logs as it likes
        },
        "RoleArn": job.role_arn,
        "HyperParameters": job_hyperparameters(job),
        "OutputDataConfig": {"S3OutputPath": job.s3("output")},
        "ResourceConfig": _resources(job),
        "StoppingCondition": {"MaxRuntimeInSeconds": job.max_run_seconds},
        "CheckpointConfig": {"S3Uri": job.s3(job.job_name, "checkpoints"), "LocalPath": CHECKPOINT_DIR},
        "Environment": env,
        "EnableNetworkIsolation": False,
        "EnableInterContainerTrafficEncryption": False,
    }
    if job.inputs:
        request["InputDataConfig"] = [_channel(job, name, uri) for name, uri in job.inputs.items()]
    if job.max_retries:
        request["RetryStrategy"] = {"MaximumRetryAttempts": job.max_retries}
    return request


def _resources(job: SageMakerJob) -> dict:
    if not job.heterogeneous:
        return {
            "InstanceType": job.instance.sagemaker_name,
            "InstanceCount": job.instance_count,
            "VolumeSizeInGB": job.volume_gb,
        }
    return {"InstanceGroups": instance_groups(job.recipe), "VolumeSizeInGB": job.volume_gb}


def _channel(job: SageMakerJob, name: str, uri: str) -> dict:
    """An input channel; in a heterogeneous job the data channel reaches the data group only."""
    source = {"S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}
    if name in job.data_channels:
        source["InstanceGroupNames"] = [group_name(job.recipe, "data")]
    return {"ChannelName": name, "InputMode": "File", "DataSource": {"S3DataSource": source}}


def requirements(extras: tuple[str, ...] = ()) -> str:
    """requirements.txt for the container's toolkit: this package's own dependencies and those of `extras`, less
    torch and torch-xla (the image's Neuron builds stay)."""
    try:
        reqs = requires("neurontrain") or []
    except PackageNotFoundError:
        reqs = []
    keep = []
    for req in reqs:
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", req)
        if extra is not None and extra.group(1) not in extras:
            continue
        name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip()
        if name.lower() not in _NOT_RUNTIME_DEPS:
            keep.append(req.split(";")[0].strip())
    return "".join(f"{r}\n" for r in keep)


def _source_files(source_dir: Path) -> list[Path]:
    """The files of a Lightning script's folder (hidden names and caches left out), at most MAX_SOURCE_BYTES."""
    files = [
        p
        for p in sorted(source_dir.rglob("*"))
        if p.is_file()
        and not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(source_dir).parts)
    ]
    total = sum(p.stat().st_size for p in files)
    if total > MAX_SOURCE_BYTES:
        raise UsageError(
            f"the script's folder {source_dir} holds {total / 2**20:.0f} MiB; the job ships it whole as its source: "
            f"keep data out of it (give it to the job with --input NAME=s3://...)"
        )
    return files


def source_tarball(source_dir: Path | None = None, heterogeneous: bool = False) -> bytes:
    """sourcedir.tar.gz: the entry script, this package, and its requirements for the toolkit to install; for a
    Lightning job its script's folder too (and the lightning extra's requirements); a heterogeneous job adds
    the ray extra's."""
    package = Path(neurontrain.__file__).resolve().parent
    entry = (
        '"""SageMaker entry point: the training toolkit runs it once per instance."""\n'
        "import sys\nfrom pathlib import Path\n\n"
        "sys.path.insert(0, str(Path(__file__).resolve().parent))\n"
        "from neurontrain.launch.sagemaker_entry import main  # noqa: E402\n\n"
        "sys.exit(main())\n"
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

        add(ENTRY_SCRIPT, entry.encode())
        extras = ("lightning",) if source_dir is not None else ("ray",) if heterogeneous else ()
        add("requirements.txt", requirements(extras).encode())
        for path in sorted(package.rglob("*.py")):
            add(f"neurontrain/{path.relative_to(package)}", path.read_bytes())
        for path in _source_files(source_dir) if source_dir is not None else []:
            add(f"{LIGHTNING_SOURCE}/{path.relative_to(source_dir)}", path.read_bytes())
    return buf.getvalue()


def submit(job: SageMakerJob, sagemaker_client: Any, s3_client: Any) -> dict:
    """Upload sourcedir.tar.gz, then create the training job; returns {job name, ARN, request}."""
    request = training_job_request(job)
    bucket, _, key = json.loads(request["HyperParameters"]["sagemaker_submit_directory"])[5:].partition("/")
    source = source_tarball(Path(job.source_dir) if job.lightning else None, job.heterogeneous)
    s3_client.put_object(Bucket=bucket, Key=key, Body=source)
    response = sagemaker_client.create_training_job(**request)
    return {
        "job_name": job.job_name,
        "arn": response["TrainingJobArn"],
        "source": f"s3://{bucket}/{key}",
        "checkpoints": request["CheckpointConfig"]["S3Uri"],
        "model": request["OutputDataConfig"]["S3OutputPath"],
    }
