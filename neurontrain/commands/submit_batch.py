"""`neurontrain submit batch RECIPE --job-queue Q --nodes N`: an AWS Batch multi-node parallel job (the
requests: `launch/batch.py`; the calls: `launch/batch_submit.py`; each node: `launch/batch_entry.py`).

It takes `run`'s worker arguments as the other submitters do: the recipe, with --set and --backend applied,
travels as a JSON file in S3, and the other worker arguments reach each node's `neurontrain run`."""

from __future__ import annotations

import argparse
import json

from neurontrain.commands.arguments import add_worker_arguments, recipe_overrides, worker_argv
from neurontrain.errors import UsageError
from neurontrain.launch import dlc
from neurontrain.launch.batch import BatchJob, job_definition_request, submit_job_request
from neurontrain.launch.batch_submit import node_environment, shipment, submit_with_aws
from neurontrain.launch.instances import ec2_instance
from neurontrain.launch.jobcheck import check_world, load_job_recipe
from neurontrain.launch.submit import aws_region, compile_cache_override, job_name
from neurontrain.logs import get_logger

log = get_logger(__name__)

# `run`'s worker arguments the job carries without its command line: the recipe (overrides applied) is shipped,
# and the run directory is the node's own.
BATCH_CARRIED = frozenset({"recipe", "overrides", "backend", "output_dir"})


def add_batch_arguments(batch: argparse.ArgumentParser) -> None:
    add_worker_arguments(batch, output_dir=False, recipe_required=True)
    batch.add_argument("--job-queue", required=True, help="AWS Batch job queue (name or ARN)")
    batch.add_argument("--nodes", type=int, required=True, help="instances of the multi-node job")
    batch.add_argument("--instance-type", default="trn1.32xlarge", help="trn1, trn1n, trn2 or an EC2 name")
    batch.add_argument("--nproc-per-node", type=int, help="workers per node (default: the instance type's)")
    batch.add_argument(
        "--checkpoint-dir",
        required=True,
        metavar="s3://BUCKET/PREFIX",
        help="the job's source and recipe, and under <job id>/ its checkpoints (a retried attempt resumes from "
        "them), model, summary and metrics",
    )
    batch.add_argument("--job-name", help="default: <recipe name>-<time>")
    batch.add_argument("--job-definition-name", default="neurontrain", help="job definition (reused by content)")
    batch.add_argument("--job-role", help="IAM role ARN of the containers (S3 access); default: the instance role")
    batch.add_argument("--share-identifier", help="fair-share identifier (required by a fair-share queue)")
    batch.add_argument("--priority", type=int, help="scheduling priority in a fair-share queue (0-9999)")
    batch.add_argument("--attempts", type=int, default=3, help="attempts of the job (1-10; default 3)")
    batch.add_argument("--timeout", type=int, help="seconds an attempt may run (at least 60)")
    batch.add_argument("--memory", type=int, dest="memory_mib", help="MiB a node's container gets")
    batch.add_argument("--shared-memory", type=int, dest="shared_memory_mib", help="MiB of /dev/shm")
    batch.add_argument("--master-port", type=int, default=29500, help="rendezvous port on the main node")
    batch.add_argument("--compile-cache", metavar="s3://BUCKET/PREFIX", help="compile cache every node pulls")
    batch.add_argument("--region", help="default: AWS_REGION or the AWS configuration's region")
    batch.add_argument("--neuron-sdk", help="Neuron SDK release of the training image (default: the newest for XLA)")
    batch.add_argument("--image", help="container image URI (overrides --neuron-sdk)")
    batch.add_argument("--dry-run", action="store_true", help="print the requests; call nothing")


def run_batch(args: argparse.Namespace) -> int:
    instance = ec2_instance(args.instance_type)
    region = dlc.check_region(aws_region(args.region))
    overrides = [*recipe_overrides(args), *compile_cache_override(args.compile_cache, shared_paths=False)]
    recipe = load_job_recipe(args.recipe, overrides)
    if args.nodes > 1 and recipe.train.zero1 == "auto":  # whole-state checkpoints: see below
        recipe = load_job_recipe(args.recipe, [*overrides, "train.zero1=false"])
    job = BatchJob(
        job_name=job_name(args.job_name, recipe.name),
        job_queue=args.job_queue,
        nodes=args.nodes,
        instance=instance,
        image=args.image or dlc.image_uri(region, args.neuron_sdk or dlc.DEFAULT_SDK),
        checkpoint_dir=args.checkpoint_dir,
        definition_name=args.job_definition_name,
        attempts=args.attempts,
        timeout=args.timeout,
        share_identifier=args.share_identifier,
        priority=args.priority,
        job_role_arn=args.job_role,
        nproc_per_node=args.nproc_per_node,
        memory_mib=args.memory_mib,
        shared_memory_mib=args.shared_memory_mib,
        master_port=args.master_port,
    )
    check_world(recipe, job.nodes * job.workers_per_node)
    if job.nodes > 1 and (recipe.parallel.fsdp or recipe.train.zero1 is True):
        raise UsageError(
            "parallel.fsdp and train.zero1 write checkpoint shards on every node; a Batch job's nodes share no "
            "file system, so a multi-node job keeps whole-state checkpoints (train.zero1 auto means false here; "
            "unset them, or use submit slurm with a shared file system)"
        )
    if not recipe.checkpoint.resume or recipe.checkpoint.every == 0:
        log.warning(
            f"warning: checkpoint.every {recipe.checkpoint.every} and resume {recipe.checkpoint.resume}: "
            "a retried attempt starts from step 0"
        )
    run_args = worker_argv(args, carried=BATCH_CARRIED)
    shipped = recipe.model_dump(mode="json")
    ship = shipment(shipped)
    if args.dry_run:
        env = node_environment(job, ship, run_args)
        requests = {
            "register_job_definition": job_definition_request(job),
            "submit_job": submit_job_request(job, "<the job definition's ARN>", env),
            "recipe": shipped,  # what NEURONTRAIN_RECIPE_URL will hold
        }
        print(json.dumps(requests, indent=2))
        return 0
    print(json.dumps(submit_with_aws(job, ship, run_args, region)))
    return 0
