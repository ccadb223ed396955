"""`neurontrain submit slurm|sagemaker RECIPE`: hand a recipe to a scheduler, validated here first (a bad
global batch, worker count, instance type, region or bucket fails now, not after the job waited in a queue).

Nothing here imports torch or torch-xla: the checks are the recipe's and the batch arithmetic's
(`launch/jobcheck.py`); `run` builds the full plan on the nodes before any worker starts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from neurontrain.errors import NeurontrainError, UsageError

BACKENDS = ["auto", "neuron", "xla-cpu", "xla-cuda", "eager"]


def add_submit_parser(sub) -> None:
    submit = sub.add_parser("submit", help="submit a recipe to SLURM or SageMaker")
    ssub = submit.add_subparsers(dest="submit_command", parser_class=type(submit))

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("recipe", help="YAML recipe")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
        p.add_argument("--job-name", help="default: <recipe name>-<time>")
        p.add_argument("--compile-cache", metavar="URL",
                       help="compile cache for the job (s3://bucket/prefix): the job's run pulls the plan's compiled "
                            "modules from it into each node's cache before training and pushes new ones after")

    slurm = ssub.add_parser("slurm", help="write an sbatch script (and submit it with --submit)")
    common(slurm)
    slurm.add_argument("--nodes", type=int, required=True)
    slurm.add_argument("--instance-type", default="trn1", help="trn1, trn1n, trn2 (or an EC2 name such as "
                                                               "trn1.2xlarge): workers per node and core grouping")
    slurm.add_argument("--nproc-per-node", type=int, help="workers per node (default: the instance type's)")
    slurm.add_argument("--output-dir", "-o", help="run directory on the shared file system (default runs/<recipe>)")
    slurm.add_argument("--backend", choices=BACKENDS)
    slurm.add_argument("--partition")
    slurm.add_argument("--time", dest="time_limit", help="Slurm time limit, e.g. 12:00:00")
    slurm.add_argument("--account")
    slurm.add_argument("--max-restarts", type=int, default=1)
    slurm.add_argument("--master-port", type=int, default=29500, help="rendezvous port on the first node")
    slurm.add_argument("--node-cache-dir", default="/var/tmp/neurontrain-cache",
                       help="node-local compile cache directory (NEURONTRAIN_CACHE_DIR on every node)")
    slurm.add_argument("--python", default=sys.executable, help="interpreter on the nodes (default: this one)")
    slurm.add_argument("--script", help="where to write the script (default <output-dir>/<job name>.sbatch)")
    slurm.add_argument("--submit", action="store_true", help="run sbatch on the script")

    sm = ssub.add_parser("sagemaker", help="create a SageMaker training job")
    common(sm)
    sm.add_argument("--role", required=True, help="IAM role ARN the job runs as")
    sm.add_argument("--instance-type", default="ml.trn1.32xlarge")
    sm.add_argument("--instance-count", type=int, default=1)
    sm.add_argument("--output", required=True, help="s3://bucket/prefix for source, checkpoints and the model")
    sm.add_argument("--input", dest="inputs", action="append", default=[], metavar="NAME=s3://BUCKET/PREFIX",
                    help="a data channel (repeatable); the recipe's data.path points at the data channel")
    sm.add_argument("--data-channel", help="the channel data.path reads (default: 'train', or the only channel)")
    sm.add_argument("--region", help="default: AWS_REGION or the AWS configuration's region")
    sm.add_argument("--neuron-sdk", help="Neuron SDK release of the training image (default: the newest one that "
                                         "trains with PyTorch/XLA)")
    sm.add_argument("--image", help="training image URI (overrides --neuron-sdk)")
    sm.add_argument("--max-run", type=int, default=24 * 3600, help="seconds before SageMaker stops the job")
    sm.add_argument("--max-retries", type=int, default=1,
                    help="times SageMaker retries a job that failed on an internal error; a retry resumes from the "
                         "latest checkpoint in /opt/ml/checkpoints")
    sm.add_argument("--volume-size", type=int, default=512, help="GB of EBS per instance")
    sm.add_argument("--dry-run", action="store_true", help="print the request; call nothing")


def _job_name(args: argparse.Namespace, recipe_name: str) -> str:
    if args.job_name:
        return args.job_name
    base = re.sub(r"[^A-Za-z0-9]+", "-", recipe_name).strip("-")[:44] or "neurontrain"
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}"


def _cache_override(args: argparse.Namespace, shared_paths: bool) -> list[str]:
    """--compile-cache URL -> the job's runtime.compile_cache. Every node must reach it: s3://, or (Slurm) a
    directory on the shared file system."""
    url = args.compile_cache
    if not url:
        return []
    if url.startswith("s3://"):
        from neurontrain.launch.dlc import check_s3_url

        check_s3_url(url, "--compile-cache")
    elif shared_paths and "://" not in url:
        url = str(Path(url).resolve())
    else:
        raise UsageError(f"--compile-cache {url!r} must be s3://bucket/prefix"
                         + (" or a directory on the shared file system" if shared_paths else ""))
    return [f"runtime.compile_cache={url}"]


def cmd_submit(args: argparse.Namespace) -> int:
    if args.submit_command is None:
        raise UsageError("submit needs a scheduler: slurm, sagemaker")
    return _slurm(args) if args.submit_command == "slurm" else _sagemaker(args)


def _slurm(args: argparse.Namespace) -> int:
    from neurontrain.launch.instances import ec2_instance
    from neurontrain.launch.jobcheck import check_job
    from neurontrain.launch.slurm import SlurmJob, render_sbatch, submit

    instance = ec2_instance(args.instance_type)
    if args.nodes < 1 or (args.nproc_per_node is not None and args.nproc_per_node < 1):
        raise UsageError("--nodes and --nproc-per-node must be at least 1")
    workers = args.nproc_per_node or instance.workers
    cache = _cache_override(args, shared_paths=True)
    recipe = check_job(args.recipe, list(args.overrides) + cache, args.nodes * workers, args.backend)
    output_dir = Path(args.output_dir or Path("runs") / recipe.name).resolve()
    job = SlurmJob(Path(args.recipe).resolve(), output_dir, args.nodes, instance, args.python,
                   _job_name(args, recipe.name), args.nproc_per_node, list(args.overrides), args.backend,
                   args.partition, args.time_limit, args.account, args.max_restarts, args.master_port,
                   cache[0].partition("=")[2] if cache else None, args.node_cache_dir).validate()
    output_dir.mkdir(parents=True, exist_ok=True)  # Slurm does not create the --output directory
    script = Path(args.script) if args.script else output_dir / f"{job.job_name}.sbatch"
    script.write_text(render_sbatch(job))
    script.chmod(0o755)
    result = {"script": str(script), "nodes": job.nodes, "workers": job.nodes * workers,
              "instance_type": instance.name}
    if args.submit:
        result["job_id"] = submit(script)
        result["log"] = str(output_dir / f"slurm-{result['job_id']}.out")
        result["node_logs"] = str(output_dir / "logs" / result["job_id"])
    print(json.dumps(result))
    return 0


def _container_paths(args: argparse.Namespace, inputs: dict[str, str]) -> list[str]:
    """Overrides that point the recipe's data.path at the data channel's directory in the container."""
    from neurontrain.launch.sagemaker import channel_dir

    channel = args.data_channel or ("train" if "train" in inputs else next(iter(inputs)) if len(inputs) == 1 else None)
    if channel is None:
        if args.data_channel is None and inputs:
            raise UsageError(f"which channel is the data? pass --data-channel (channels: {', '.join(inputs)})")
        return []
    if channel not in inputs:
        raise UsageError(f"--data-channel {channel}: no --input {channel}=s3://...")
    own = [o.partition("=")[2].strip() for o in args.overrides if o.partition("=")[0].strip() == "data.path"]
    if own and own[-1].startswith(channel_dir(channel) + "/"):
        return []  # a file inside the channel, named by the user
    return [f"data.path={channel_dir(channel)}"]


def _check_container_paths(recipe) -> None:
    """Paths in the recipe must exist in the container: local files here are refused with the way to send them."""
    from neurontrain.launch.sagemaker import CHANNEL_ROOT

    if recipe.data.source in ("json", "csv", "parquet") and not recipe.data.path.startswith(CHANNEL_ROOT + "/"):
        raise UsageError(f"data.path {recipe.data.path} is a path on this machine, which the SageMaker job cannot "
                         f"read: upload it to S3 and pass --input train=s3://BUCKET/PREFIX")
    for key, value in (("model.pretrained", recipe.model.pretrained), ("tokenizer.pretrained",
                                                                       recipe.tokenizer.pretrained)):
        if value and Path(value).exists() and not value.startswith(CHANNEL_ROOT + "/"):
            raise UsageError(f"{key} {value} is a local directory the SageMaker job cannot read: upload it and pass "
                             f"--input {key.split('.')[0]}=s3://BUCKET/PREFIX --set {key}={CHANNEL_ROOT}/"
                             f"{key.split('.')[0]}")


def _region(args: argparse.Namespace) -> str:
    region = args.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not region:
        import boto3

        region = boto3.session.Session().region_name
    if not region:
        raise UsageError("no AWS region: pass --region or set AWS_REGION")
    return region


def _sagemaker(args: argparse.Namespace) -> int:
    from neurontrain.launch import dlc
    from neurontrain.launch.instances import sagemaker_instance
    from neurontrain.launch.jobcheck import check_job
    from neurontrain.launch.sagemaker import SageMakerJob, parse_inputs, training_job_request

    instance = sagemaker_instance(args.instance_type)
    if args.instance_count < 1:
        raise UsageError("--instance-count must be at least 1")
    if args.max_run < 1 or args.volume_size < 1:
        raise UsageError("--max-run and --volume-size must be positive")
    region = dlc.check_region(_region(args))
    image = args.image or dlc.image_uri(region, args.neuron_sdk or dlc.DEFAULT_SDK)
    inputs = parse_inputs(args.inputs)
    overrides = list(args.overrides) + _cache_override(args, shared_paths=False) + _container_paths(args, inputs)
    recipe = check_job(args.recipe, overrides, args.instance_count * instance.workers)
    _check_container_paths(recipe)
    if args.max_retries and (not recipe.checkpoint.resume or recipe.checkpoint.every == 0):
        print(f"neurontrain: warning: --max-retries {args.max_retries} with checkpoint.every "
              f"{recipe.checkpoint.every} and resume {recipe.checkpoint.resume}: a retried job starts from step 0",
              file=sys.stderr)
    job = SageMakerJob(recipe.model_dump(mode="json"), args.role, instance, args.instance_count, args.output,
                       region, _job_name(args, recipe.name), image, args.max_run, args.volume_size, inputs,
                       args.max_retries).validate()
    request = training_job_request(job)
    if args.dry_run:
        print(json.dumps(request, indent=2))
        return 0
    print(json.dumps(_create(job, region)))
    return 0


def _create(job, region: str) -> dict:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    from neurontrain.launch.sagemaker import submit

    try:
        return submit(job, boto3.client("sagemaker", region_name=region), boto3.client("s3", region_name=region))
    except NoCredentialsError:
        raise UsageError("no AWS credentials found (environment, ~/.aws or an instance role)") from None
    except ClientError as exc:
        err = exc.response.get("Error", {})
        raise NeurontrainError(f"SageMaker/S3 refused the job: {err.get('Code', '?')}: {err.get('Message', '')}") from None
    except BotoCoreError as exc:
        raise NeurontrainError(f"cannot reach AWS: {exc}") from None
