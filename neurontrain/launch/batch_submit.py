"""`submit batch`'s AWS calls (boto3; the requests themselves are `launch/batch.py`'s): upload the source and the
recipe, read the job queue, register the job definition or reuse the one of the same content, submit the job."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from neurontrain.launch.batch import (
    BatchJob,
    check_queue,
    job_definition_request,
    log_hint,
    reusable_definition,
    submit_job_request,
)
from neurontrain.launch.sagemaker import source_tarball
from neurontrain.launch.submit import aws_refusals


@dataclass(frozen=True)
class Shipment:
    """What the nodes fetch from S3: the source tarball and the recipe, each named by its content."""

    source: bytes
    recipe: bytes

    def urls(self, job: BatchJob) -> dict[str, str]:
        return {
            "source": job.s3("source", _digest(self.source) + ".tar.gz"),
            "recipe": job.s3("recipes", _digest(self.recipe) + ".json"),
        }


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:20]


def shipment(recipe: dict) -> Shipment:
    return Shipment(source_tarball(), json.dumps(recipe, sort_keys=True).encode())


def node_environment(job: BatchJob, ship: Shipment, run_args: list[str]) -> dict[str, str]:
    """The job's own variables on every node (the node entry's inputs)."""
    urls = ship.urls(job)
    return {
        "NEURONTRAIN_SOURCE": urls["source"],
        "NEURONTRAIN_RECIPE_URL": urls["recipe"],
        "NEURONTRAIN_RUN_ARGS": json.dumps(run_args),
        "NEURONTRAIN_CHECKPOINTS": job.checkpoint_dir.rstrip("/"),
    }


def _put_once(s3: Any, url: str, body: bytes) -> None:
    bucket, _, key = url[len("s3://") :].partition("/")
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1).get("Contents") or []
    if not any(item["Key"] == key for item in listed):
        s3.put_object(Bucket=bucket, Key=key, Body=body)


def _definition(batch: Any, request: dict) -> tuple[str, bool]:
    """(ARN, reused) of the job definition with this content: the newest ACTIVE revision of the name that
    carries the content's hash, else a new revision."""
    active: list[dict] = []
    pages = batch.get_paginator("describe_job_definitions")
    for page in pages.paginate(jobDefinitionName=request["jobDefinitionName"], status="ACTIVE"):
        active += page.get("jobDefinitions", [])
    arn = reusable_definition(request, active)
    if arn is not None:
        return arn, True
    return batch.register_job_definition(**request)["jobDefinitionArn"], False


def submit(job: BatchJob, ship: Shipment, run_args: list[str], region: str, clients: tuple[Any, Any]) -> dict:
    """Read the queue, ship, register or reuse the definition, submit; returns what `submit batch` prints."""
    batch, s3 = clients
    queues = batch.describe_job_queues(jobQueues=[job.job_queue]).get("jobQueues", [])
    queue = queues[0] if queues else None
    names = [env["computeEnvironment"] for env in (queue or {}).get("computeEnvironmentOrder", [])]
    environments = (
        batch.describe_compute_environments(computeEnvironments=names)["computeEnvironments"] if names else []
    )
    check_queue(job, queue, environments)
    urls = ship.urls(job)
    _put_once(s3, urls["source"], ship.source)
    _put_once(s3, urls["recipe"], ship.recipe)
    definition, reused = _definition(batch, job_definition_request(job))
    response = batch.submit_job(**submit_job_request(job, definition, node_environment(job, ship, run_args)))
    job_id = response["jobId"]
    return {
        "job_id": job_id,
        "job_name": response.get("jobName", job.job_name),
        "job_definition": definition,
        "job_definition_reused": reused,
        "job_queue": job.job_queue,
        "nodes": job.nodes,
        "workers": job.nodes * job.workers_per_node,
        "checkpoints": job.s3(job_id, "checkpoints"),
        "logs": log_hint(job_id, region),
    }


def submit_with_aws(job: BatchJob, ship: Shipment, run_args: list[str], region: str) -> dict:
    """`submit` with boto3 clients of the region; AWS's refusals as one line."""
    import boto3  # lazy: the AWS SDK loads only when a job is really submitted (not for --dry-run)

    with aws_refusals("AWS Batch/S3"):
        clients = (boto3.client("batch", region_name=region), boto3.client("s3", region_name=region))
        return submit(job, ship, run_args, region, clients)
