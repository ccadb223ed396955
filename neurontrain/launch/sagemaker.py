"""`neurontrain submit sagemaker`: a SageMaker training job on trn1/trn2 instances through boto3.

The job runs the Neuron PyTorch training image with `torch_distributed` enabled (the SageMaker training
toolkit starts the entry script under torchrun on every instance, one worker per NeuronCore). The recipe travels
as hyperparameters (one dotted key per leaf, JSON values, as the SageMaker SDK encodes them); the entry script
and this package travel in sourcedir.tar.gz under --output. Checkpoints go to /opt/ml/checkpoints, which
SageMaker syncs with CheckpointConfig.S3Uri, so a retried or restarted job resumes from the latest complete one.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neurontrain.errors import UsageError

# Neuron deep-learning-container account and repository; the tag follows the documented
# <torch>-neuronx-py<python>-sdk<neuron>-ubuntu<os> pattern. Check the tag for your region and release
# (https://github.com/aws-neuron/deep-learning-containers) and pass --image to override.
IMAGE_ACCOUNT = "763104351884"
IMAGE_REPOSITORY = "pytorch-training-neuronx"
IMAGE_TAG = "2.9.0-neuronx-py311-sdk2.28.0-ubuntu22.04"
NEURONCORES = {"ml.trn1.2xlarge": 2, "ml.trn1.32xlarge": 32, "ml.trn1n.32xlarge": 32, "ml.trn2.48xlarge": 64}
ENTRY_SCRIPT = "neurontrain_sagemaker_entry.py"
CHECKPOINT_DIR = "/opt/ml/checkpoints"
_HP_PREFIX = "recipe."
_MAX_HYPERPARAMETERS, _MAX_VALUE = 100, 2500  # SageMaker's limits on HyperParameters

ENTRY_SOURCE = '''"""SageMaker entry point (run under torchrun by the training toolkit): rebuild the recipe, run it."""
import json, os, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from neurontrain.launch.sagemaker import recipe_from_hyperparameters  # noqa: E402
from neurontrain.cli import main  # noqa: E402

hps = json.loads(os.environ.get("SM_HPS") or Path("/opt/ml/input/config/hyperparameters.json").read_text())
work = Path(os.environ.get("NEURONTRAIN_SM_WORK", "/tmp/neurontrain"))
work.mkdir(parents=True, exist_ok=True)
recipe = work / "recipe.json"
recipe.write_text(json.dumps(recipe_from_hyperparameters(hps)))
sys.exit(main(["run", str(recipe), "--output-dir", os.environ.get("NEURONTRAIN_SM_OUTPUT", "{checkpoints}")]))
'''.replace("{checkpoints}", CHECKPOINT_DIR)


@dataclass(frozen=True)
class SageMakerJob:
    recipe: dict                   # the validated recipe (overrides applied), as plain data
    role_arn: str
    instance_type: str
    instance_count: int
    output: str                    # s3://bucket/prefix: model, source and checkpoints go under it
    region: str
    job_name: str
    image: str | None = None
    max_run_seconds: int = 24 * 3600
    volume_gb: int = 512
    compile_cache: str | None = None
    environment: dict[str, str] = field(default_factory=dict)

    def validate(self) -> "SageMakerJob":
        if not re.fullmatch(r"arn:aws[a-z\-]*:iam::\d{12}:role/[\w+=,.@/\-]+", self.role_arn):
            raise UsageError(f"--role {self.role_arn!r} is not an IAM role ARN (arn:aws:iam::123456789012:role/NAME)")
        if not self.output.startswith("s3://") or len(self.output.rstrip("/")) <= len("s3://"):
            raise UsageError(f"--output {self.output!r} must be s3://bucket/prefix")
        if not self.instance_type.startswith("ml."):
            raise UsageError(f"--instance-type {self.instance_type!r} must be a SageMaker type such as ml.trn1.32xlarge")
        if self.instance_count < 1:
            raise UsageError("--instance-count must be at least 1")
        if not re.fullmatch(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}", self.job_name):
            raise UsageError(f"job name {self.job_name!r}: 1-63 letters, digits and hyphens")
        return self

    @property
    def image_uri(self) -> str:
        return self.image or f"{IMAGE_ACCOUNT}.dkr.ecr.{self.region}.amazonaws.com/{IMAGE_REPOSITORY}:{IMAGE_TAG}"

    def s3(self, *parts: str) -> str:
        return "/".join([self.output.rstrip("/"), *parts])


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
            out[_HP_PREFIX + path] = json.dumps(node)

    walk(recipe, "")
    return out


def recipe_from_hyperparameters(hps: dict[str, Any]) -> dict:
    recipe: dict = {}
    for key, raw in hps.items():
        if not key.startswith(_HP_PREFIX):
            continue
        value = json.loads(raw) if isinstance(raw, str) else raw  # the toolkit may hand decoded values
        node = recipe
        *parents, leaf = key[len(_HP_PREFIX):].split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return recipe


def training_job_request(job: SageMakerJob) -> dict:
    """The create_training_job parameters (pure)."""
    hps = recipe_hyperparameters(job.recipe)
    hps.update({
        "sagemaker_program": json.dumps(ENTRY_SCRIPT),
        "sagemaker_submit_directory": json.dumps(job.s3(job.job_name, "source", "sourcedir.tar.gz")),
        "sagemaker_region": json.dumps(job.region),
        "sagemaker_torch_distributed_enabled": "true",
        "sagemaker_instance_type": json.dumps(job.instance_type),
    })
    if len(hps) > _MAX_HYPERPARAMETERS:
        raise UsageError(f"the recipe has {len(hps)} hyperparameters with SageMaker's own; the limit is "
                         f"{_MAX_HYPERPARAMETERS} (move model.config into a pretrained config directory)")
    for key, value in hps.items():
        if len(value) > _MAX_VALUE or len(key) > 256:
            raise UsageError(f"hyperparameter {key} is longer than SageMaker allows ({_MAX_VALUE} characters)")
    env = {"NEURONTRAIN_SM_OUTPUT": CHECKPOINT_DIR, "FI_EFA_FORK_SAFE": "1", **job.environment}
    if job.compile_cache:
        env["NEURON_COMPILE_CACHE_URL"] = job.compile_cache
    return {
        "TrainingJobName": job.job_name,
        "AlgorithmSpecification": {"TrainingImage": job.image_uri, "TrainingInputMode": "File",
                                   "EnableSageMakerMetricsTimeSeries": True,
                                   "MetricDefinitions": [{"Name": "train:loss",
                                                          "Regex": r'"final_loss": ([0-9.eE+\-]+)'}]},
        "RoleArn": job.role_arn,
        "HyperParameters": hps,
        "OutputDataConfig": {"S3OutputPath": job.s3("output")},
        "ResourceConfig": {"InstanceType": job.instance_type, "InstanceCount": job.instance_count,
                           "VolumeSizeInGB": job.volume_gb},
        "StoppingCondition": {"MaxRuntimeInSeconds": job.max_run_seconds},
        "CheckpointConfig": {"S3Uri": job.s3(job.job_name, "checkpoints"), "LocalPath": CHECKPOINT_DIR},
        "Environment": env,
        "EnableNetworkIsolation": False,
        "EnableInterContainerTrafficEncryption": False,
    }


def source_tarball() -> bytes:
    """sourcedir.tar.gz: the entry script, this package, and its requirements for the toolkit to install."""
    import neurontrain

    package = Path(neurontrain.__file__).resolve().parent
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

        add(ENTRY_SCRIPT, ENTRY_SOURCE.encode())
        add("requirements.txt", b"transformers>=5\ntokenizers\nsafetensors\ndatasets\npydantic>=2\nPyYAML\ntqdm\n")
        for path in sorted(package.rglob("*.py")):
            add(f"neurontrain/{path.relative_to(package)}", path.read_bytes())
    return buf.getvalue()


def submit(job: SageMakerJob, sagemaker_client: Any, s3_client: Any) -> dict:
    """Upload sourcedir.tar.gz, then create the training job; returns {job name, ARN, request}."""
    request = training_job_request(job)
    bucket, _, key = json.loads(request["HyperParameters"]["sagemaker_submit_directory"])[5:].partition("/")
    s3_client.put_object(Bucket=bucket, Key=key, Body=source_tarball())
    response = sagemaker_client.create_training_job(**request)
    return {"job_name": job.job_name, "arn": response["TrainingJobArn"], "source": f"s3://{bucket}/{key}",
            "checkpoints": request["CheckpointConfig"]["S3Uri"]}
