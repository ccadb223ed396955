"""What `submit slurm|sagemaker` checks and decides beyond the job objects: the job name, the compile cache
every node must reach, where the recipe's paths point inside a SageMaker container, the AWS region, and the
SageMaker call itself.

Nothing here imports torch or torch-xla: the recipe checks are the recipe's and the batch arithmetic's
(`launch/jobcheck.py`); `run` builds the full plan on the nodes before any worker starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

from neurontrain.errors import NeurontrainError, UsageError
from neurontrain.launch.dlc import check_s3_url
from neurontrain.launch.sagemaker import CHANNEL_ROOT, SageMakerJob, channel_dir, submit
from neurontrain.recipe import Recipe


def job_name(given: str | None, recipe_name: str) -> str:
    """--job-name, or <recipe name>-<time>."""
    if given:
        return given
    base = re.sub(r"[^A-Za-z0-9]+", "-", recipe_name).strip("-")[:44] or "neurontrain"
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}"


def compile_cache_override(url: str | None, shared_paths: bool) -> list[str]:
    """--compile-cache URL -> the job's runtime.compile_cache. Every node must reach it: s3://, or (Slurm) a
    directory on the shared file system."""
    if not url:
        return []
    if url.startswith("s3://"):
        check_s3_url(url, "--compile-cache")
    elif shared_paths and "://" not in url:
        url = str(Path(url).resolve())
    else:
        raise UsageError(
            f"--compile-cache {url!r} must be s3://bucket/prefix"
            + (" or a directory on the shared file system" if shared_paths else "")
        )
    return [f"runtime.compile_cache={url}"]


def container_path_overrides(data_channel: str | None, inputs: dict[str, str], overrides: list[str]) -> list[str]:
    """Overrides that point the recipe's data.path at the data channel's directory in the container."""
    channel = data_channel or ("train" if "train" in inputs else next(iter(inputs)) if len(inputs) == 1 else None)
    if channel is None:
        if data_channel is None and inputs:
            raise UsageError(f"which channel is the data? pass --data-channel (channels: {', '.join(inputs)})")
        return []
    if channel not in inputs:
        raise UsageError(f"--data-channel {channel}: no --input {channel}=s3://...")
    own = [o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == "data.path"]
    if own and own[-1].startswith(channel_dir(channel) + "/"):
        return []  # a file inside the channel, named by the user
    return [f"data.path={channel_dir(channel)}"]


def check_container_paths(recipe: Recipe) -> None:
    """Paths in the recipe must exist in the container: local files here are refused with the way to send them."""
    if recipe.data.source in ("json", "csv", "parquet") and not recipe.data.path.startswith(CHANNEL_ROOT + "/"):
        raise UsageError(
            f"data.path {recipe.data.path} is a path on this machine, which the SageMaker job cannot read: upload "
            "it to S3 and pass --input train=s3://BUCKET/PREFIX"
        )
    for key, value in (
        ("model.pretrained", recipe.model.pretrained),
        ("tokenizer.pretrained", recipe.tokenizer.pretrained),
    ):
        if value and Path(value).exists() and not value.startswith(CHANNEL_ROOT + "/"):
            channel = key.split(".")[0]
            raise UsageError(
                f"{key} {value} is a local directory the SageMaker job cannot read: upload it and pass --input "
                f"{channel}=s3://BUCKET/PREFIX --set {key}={CHANNEL_ROOT}/{channel}"
            )


def aws_region(given: str | None) -> str:
    """--region, else AWS_REGION / AWS_DEFAULT_REGION, else the AWS configuration's region."""
    region = given or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not region:
        import boto3  # lazy: the AWS SDK loads only when the environment names no region

        region = boto3.session.Session().region_name
    if not region:
        raise UsageError("no AWS region: pass --region or set AWS_REGION")
    return region


@contextlib.contextmanager
def aws_refusals(service: str) -> Iterator[None]:
    """AWS's refusals inside the block as one line: no credentials (exit 2), a service's refusal, an unreachable
    endpoint (exit 1)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError  # lazy: as boto3

    try:
        yield
    except NoCredentialsError:
        raise UsageError("no AWS credentials found (environment, ~/.aws or an instance role)") from None
    except ClientError as exc:
        err = exc.response.get("Error", {})
        raise NeurontrainError(f"{service} refused the job: {err.get('Code', '?')}: {err.get('Message', '')}") from None
    except BotoCoreError as exc:
        raise NeurontrainError(f"cannot reach AWS: {exc}") from None


def create_training_job(job: SageMakerJob, region: str) -> dict:
    """Upload the source and create the job; AWS's refusals as one line."""
    import boto3  # lazy: the AWS SDK loads only when a job is really created (not for --dry-run)

    with aws_refusals("SageMaker/S3"):
        return submit(job, boto3.client("sagemaker", region_name=region), boto3.client("s3", region_name=region))
