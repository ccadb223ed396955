"""`neurontrain submit slurm|sagemaker RECIPE`: hand a recipe to a scheduler, validated here first (a bad
global batch, worker count, instance type, region or bucket fails now, not after the job waited in a queue).

Both take `run`'s worker arguments (`add_worker_arguments`) and pass them on to the job's `neurontrain run`:
the sbatch script's node command, and the SageMaker entry through a hyperparameter. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from neurontrain.commands.arguments import (
    add_lightning_argument,
    add_worker_arguments,
    options_from,
    recipe_options_given,
    recipe_overrides,
    worker_argv,
)
from neurontrain.commands.submit_batch import add_batch_arguments, run_batch
from neurontrain.errors import UsageError
from neurontrain.fileio import write_file_atomic
from neurontrain.launch import dlc
from neurontrain.launch.instances import ec2_instance, sagemaker_instance
from neurontrain.launch.jobcheck import check_world, load_job_recipe
from neurontrain.launch.lightning_script import script_argv
from neurontrain.launch.sagemaker import SageMakerJob, channel_dir, parse_inputs, training_job_request
from neurontrain.launch.sagemaker_groups import parse_data_instances, with_groups
from neurontrain.launch.slurm import NODE_CACHE_DIR, SlurmJob, render_sbatch, submit
from neurontrain.launch.submit import (
    aws_region,
    check_container_paths,
    compile_cache_override,
    container_path_overrides,
    create_training_job,
    job_name,
)
from neurontrain.logs import get_logger

log = get_logger(__name__)

# `run`'s worker arguments a SageMaker job carries without its command line: the recipe, with --set applied,
# travels as hyperparameters, and the run directory is the job's checkpoint directory.
SAGEMAKER_CARRIED = frozenset({"recipe", "overrides", "output_dir"})


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job-name", help="default: <recipe name>-<time>")
    parser.add_argument(
        "--compile-cache",
        metavar="URL",
        help="compile cache for the job (s3://bucket/prefix): the job's run pulls the plan's compiled modules "
        "from it into each node's cache before training and pushes new ones after",
    )


def _add_slurm_arguments(slurm: argparse.ArgumentParser) -> None:
    add_worker_arguments(slurm, recipe_required=False)
    add_lightning_argument(slurm)
    _add_job_arguments(slurm)
    slurm.add_argument("--nodes", type=int, required=True)
    slurm.add_argument(
        "--instance-type",
        default="trn1",
        help="trn1, trn1n, trn2 (or an EC2 name such as trn1.2xlarge): workers per node and core grouping",
    )
    slurm.add_argument("--nproc-per-node", type=int, help="workers per node (default: the instance type's)")
    slurm.add_argument("--partition")
    slurm.add_argument("--time", dest="time_limit", help="Slurm time limit, e.g. 12:00:00")
    slurm.add_argument("--account")
    slurm.add_argument("--max-restarts", type=int, default=1)
    slurm.add_argument(
        "--data-nodes",
        type=int,
        default=0,
        help="a heterogeneous job: this many more nodes (the job's first ones) make the batches through Ray "
        "(data.service.kind ray) for the --nodes Trainium nodes",
    )
    slurm.add_argument("--master-port", type=int, default=29500, help="rendezvous port on the first node")
    slurm.add_argument(
        "--node-cache-dir",
        default=NODE_CACHE_DIR,
        help="node-local compile cache directory (NEURONTRAIN_CACHE_DIR on every node)",
    )
    slurm.add_argument("--python", default=sys.executable, help="interpreter on the nodes (default: this one)")
    slurm.add_argument("--script", help="where to write the script (default <output-dir>/<job name>.sbatch)")
    slurm.add_argument("--submit", action="store_true", help="run sbatch on the script")


def _add_sagemaker_arguments(sm: argparse.ArgumentParser) -> None:
    add_worker_arguments(sm, output_dir=False, recipe_required=False)
    add_lightning_argument(sm)
    _add_job_arguments(sm)
    sm.add_argument("--role", required=True, help="IAM role ARN the job runs as")
    sm.add_argument("--instance-type", default="ml.trn1.32xlarge")
    sm.add_argument("--instance-count", type=int, default=1)
    sm.add_argument("--output", required=True, help="s3://bucket/prefix for source, checkpoints and the model")
    sm.add_argument(
        "--input",
        dest="inputs",
        action="append",
        default=[],
        metavar="NAME=s3://BUCKET/PREFIX",
        help="a data channel (repeatable); the recipe's data.path points at the data channel",
    )
    sm.add_argument("--data-channel", help="the channel data.path reads (default: 'train', or the only channel)")
    sm.add_argument("--region", help="default: AWS_REGION or the AWS configuration's region")
    sm.add_argument(
        "--neuron-sdk",
        help="Neuron SDK release of the training image (default: the newest one that trains with PyTorch/XLA)",
    )
    sm.add_argument("--image", help="training image URI (overrides --neuron-sdk)")
    sm.add_argument("--max-run", type=int, default=24 * 3600, help="seconds before SageMaker stops the job")
    sm.add_argument(
        "--max-retries",
        type=int,
        default=1,
        help="times SageMaker retries a job that failed on an internal error; a retry resumes from the latest "
        "checkpoint in /opt/ml/checkpoints",
    )
    sm.add_argument("--volume-size", type=int, default=512, help="GB of EBS per instance")
    sm.add_argument(
        "--data-instances",
        metavar="TYPE:N",
        help="a heterogeneous job: N CPU instances of TYPE make the batches (data.service.kind ray) for the "
        "Trainium instances",
    )
    sm.add_argument("--dry-run", action="store_true", help="print the request; call nothing")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="submit_command", parser_class=type(parser))
    _add_slurm_arguments(sub.add_parser("slurm", help="write an sbatch script (and submit it with --submit)"))
    _add_sagemaker_arguments(sub.add_parser("sagemaker", help="create a SageMaker training job"))
    add_batch_arguments(sub.add_parser("batch", help="submit an AWS Batch multi-node parallel job"))


def run(args: argparse.Namespace) -> int:
    if args.submit_command is None:
        raise UsageError("submit needs a scheduler: slurm, sagemaker, batch")
    if args.submit_command == "batch":
        return run_batch(args)
    return _slurm(args) if args.submit_command == "slurm" else _sagemaker(args)


def _slurm_recipe_job(args: argparse.Namespace) -> SlurmJob:
    """The job of a recipe: every node runs `neurontrain run RECIPE` with the worker arguments given here."""
    if args.recipe is None:
        raise UsageError("submit slurm needs a RECIPE (or --lightning SCRIPT)")
    cache = compile_cache_override(args.compile_cache, shared_paths=True)
    recipe = load_job_recipe(args.recipe, [*recipe_overrides(args), *cache])
    output_dir = Path(args.output_dir or Path("runs") / recipe.name).resolve()
    # the nodes read the recipe and write the run on the shared file system: absolute paths
    served = ["data.service.kind=ray"] if args.data_nodes else []
    if served:
        load_job_recipe(args.recipe, [*recipe_overrides(args), *cache, *served])
    on_nodes = {
        "recipe": str(Path(args.recipe).resolve()),
        "output_dir": str(output_dir),
        "overrides": [*args.overrides, *cache, *served],
    }
    job = options_from(
        SlurmJob,
        args,
        output_dir=output_dir,
        run_argv=worker_argv(argparse.Namespace(**{**vars(args), **on_nodes})),
        instance=ec2_instance(args.instance_type),
        job_name=job_name(args.job_name, recipe.name),
    )
    check_world(recipe, job.nodes * job.workers_per_node)
    return job


def _slurm_lightning_job(args: argparse.Namespace) -> SlurmJob:
    """The job of a Lightning script: every node runs `neurontrain run --lightning "SCRIPT ARGS"` (the script by
    its absolute path; its own arguments as given, read in the job's working directory, the submit directory)."""
    refused = recipe_options_given(args, output_dir=False) + (["--compile-cache"] if args.compile_cache else [])
    refused += ["--data-nodes"] if args.data_nodes else []
    if refused:
        raise UsageError(
            f"--lightning takes the script's own arguments inside its quotes; {', '.join(refused)} belong to a "
            "recipe job"
        )
    script, *script_args = script_argv(args.lightning)
    stem = Path(script).stem
    return options_from(
        SlurmJob,
        args,
        output_dir=Path(args.output_dir or Path("runs") / stem).resolve(),
        run_argv=["--lightning", shlex.join([str(Path(script).resolve()), *script_args])],
        instance=ec2_instance(args.instance_type),
        job_name=job_name(args.job_name, stem),
    )


def _slurm(args: argparse.Namespace) -> int:
    job = _slurm_lightning_job(args) if args.lightning is not None else _slurm_recipe_job(args)
    instance, output_dir = job.instance, job.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)  # Slurm does not create the --output directory
    script = Path(args.script) if args.script else output_dir / f"{job.job_name}.sbatch"
    write_file_atomic(script, render_sbatch(job).encode())
    script.chmod(0o755)
    result = {
        "script": str(script),
        "nodes": job.nodes,
        "workers": job.nodes * job.workers_per_node,
        "instance_type": instance.name,
    }
    if args.submit:
        result["job_id"] = submit(script)
        result["log"] = str(output_dir / f"slurm-{result['job_id']}.out")
        result["node_logs"] = str(output_dir / "logs" / result["job_id"])
    print(json.dumps(result))
    return 0


def _sagemaker_recipe_job(args: argparse.Namespace, common: dict) -> SageMakerJob:
    if args.recipe is None:
        raise UsageError("submit sagemaker needs a RECIPE (or --lightning SCRIPT)")
    inputs = common["inputs"]
    overrides = [
        *recipe_overrides(args),
        *compile_cache_override(args.compile_cache, shared_paths=False),
        *container_path_overrides(args.data_channel, inputs, args.overrides),
    ]
    recipe = load_job_recipe(args.recipe, overrides)
    check_container_paths(recipe)
    shipped, data_channels = recipe.model_dump(mode="json"), ()
    if args.data_instances:
        trainium = (common["instance"].sagemaker_name, common["instance_count"])
        shipped = with_groups(shipped, parse_data_instances(args.data_instances), trainium)
        data_channels = tuple(name for name in inputs if f"{recipe.data.path}/".startswith(channel_dir(name) + "/"))
    job = SageMakerJob(
        recipe=shipped,
        job_name=job_name(args.job_name, recipe.name),
        run_args=worker_argv(args, carried=SAGEMAKER_CARRIED),
        data_channels=data_channels,
        **common,
    )
    check_world(recipe, job.instance_count * job.instance.workers)
    if args.max_retries and (not recipe.checkpoint.resume or recipe.checkpoint.every == 0):
        log.warning(
            f"warning: --max-retries {args.max_retries} with checkpoint.every {recipe.checkpoint.every} and resume "
            f"{recipe.checkpoint.resume}: a retried job starts from step 0"
        )
    return job


def _sagemaker_lightning_job(args: argparse.Namespace, common: dict) -> SageMakerJob:
    """The job of a Lightning script: its folder travels in the job's source; every instance runs
    `neurontrain run --lightning "SCRIPT ARGS"` in the job's checkpoint directory (synced with S3)."""
    refused = [o for o in recipe_options_given(args, output_dir=False) if o != "--dry-run"]  # ours: the request
    refused += [
        flag
        for flag, on in (
            ("--compile-cache", args.compile_cache),
            ("--data-channel", args.data_channel),
            ("--data-instances", args.data_instances),
        )
        if on
    ]
    if refused:
        raise UsageError(
            f"--lightning takes the script's own arguments inside its quotes; {', '.join(refused)} belong to a "
            "recipe job"
        )
    script, *script_args = script_argv(args.lightning)
    path = Path(script).resolve()
    return SageMakerJob(
        recipe={},
        job_name=job_name(args.job_name, path.stem),
        lightning=shlex.join([path.name, *script_args]),
        source_dir=str(path.parent),
        **common,
    )


def _sagemaker(args: argparse.Namespace) -> int:
    instance = sagemaker_instance(args.instance_type)
    region = dlc.check_region(aws_region(args.region))
    common = {
        "role_arn": args.role,
        "instance": instance,
        "instance_count": args.instance_count,
        "output": args.output,
        "region": region,
        "image": args.image or dlc.image_uri(region, args.neuron_sdk or dlc.DEFAULT_SDK),
        "max_run_seconds": args.max_run,
        "volume_gb": args.volume_size,
        "inputs": parse_inputs(args.inputs),
        "max_retries": args.max_retries,
    }
    if args.lightning is not None:
        job = _sagemaker_lightning_job(args, common)
    else:
        job = _sagemaker_recipe_job(args, common)
    request = training_job_request(job)
    if args.dry_run:
        print(json.dumps(request, indent=2))
        return 0
    print(json.dumps(create_training_job(job, region)))
    return 0
