"""`neurontrain submit slurm|sagemaker RECIPE`: hand a recipe to a scheduler, validated here first (a bad
global batch or worker count fails now, not after the job waited in a queue)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from neurontrain.errors import NeurontrainError, UsageError


def add_submit_parser(sub) -> None:
    submit = sub.add_parser("submit", help="submit a recipe to SLURM or SageMaker")
    ssub = submit.add_subparsers(dest="submit_command", parser_class=type(submit))

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("recipe", help="YAML recipe")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
        p.add_argument("--job-name", help="default: <recipe name>-<time>")
        p.add_argument("--compile-cache", help="compile cache URL for the job (NEURON_COMPILE_CACHE_URL), "
                                               "default: runtime.compile_cache when it is s3://")

    slurm = ssub.add_parser("slurm", help="write an sbatch script (and submit it with --submit)")
    common(slurm)
    slurm.add_argument("--nodes", type=int, required=True)
    slurm.add_argument("--nproc-per-node", type=int, default=32, help="workers per node (default 32: NeuronCores "
                                                                      "of a trn1.32xlarge)")
    slurm.add_argument("--output-dir", "-o", help="run directory on the shared file system (default runs/<recipe>)")
    slurm.add_argument("--backend", choices=["auto", "neuron", "xla-cpu", "xla-cuda", "eager"])
    slurm.add_argument("--partition")
    slurm.add_argument("--time", dest="time_limit", help="Slurm time limit, e.g. 12:00:00")
    slurm.add_argument("--account")
    slurm.add_argument("--max-restarts", type=int, default=1)
    slurm.add_argument("--master-port", type=int, default=29500, help="rendezvous port on the first node")
    slurm.add_argument("--python", default=sys.executable, help="interpreter on the nodes (default: this one)")
    slurm.add_argument("--script", help="where to write the script (default <output-dir>/<job name>.sbatch)")
    slurm.add_argument("--submit", action="store_true", help="run sbatch on the script")

    sm = ssub.add_parser("sagemaker", help="create a SageMaker training job")
    common(sm)
    sm.add_argument("--role", required=True, help="IAM role ARN the job runs as")
    sm.add_argument("--instance-type", default="ml.trn1.32xlarge")
    sm.add_argument("--instance-count", type=int, default=1)
    sm.add_argument("--output", required=True, help="s3://bucket/prefix for source, checkpoints and the model")
    sm.add_argument("--region", help="default: the AWS configuration's region")
    sm.add_argument("--image", help="training image URI (default: the Neuron PyTorch training image)")
    sm.add_argument("--max-run", type=int, default=24 * 3600, help="seconds before SageMaker stops the job")
    sm.add_argument("--volume-size", type=int, default=512, help="GB of EBS per instance")
    sm.add_argument("--dry-run", action="store_true", help="print the request; call nothing")


def _job_name(args: argparse.Namespace, recipe_name: str) -> str:
    if args.job_name:
        return args.job_name
    base = re.sub(r"[^A-Za-z0-9]+", "-", recipe_name).strip("-")[:44] or "neurontrain"
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}"


def _validated(args: argparse.Namespace, world: int, backend: str | None = None):
    from neurontrain.backend import resolve_backend_name
    from neurontrain.loop.planning import make_plan
    from neurontrain.recipe import load_recipe

    overrides = list(args.overrides) + ([f"runtime.backend={backend}"] if backend else [])
    recipe = load_recipe(args.recipe, overrides)
    make_plan(recipe, resolve_backend_name(recipe.runtime.backend), world=world)
    return recipe


def _cache_url(args: argparse.Namespace, recipe) -> str | None:
    if args.compile_cache:
        return args.compile_cache
    return recipe.runtime.compile_cache if recipe.runtime.compile_cache.startswith("s3://") else None


def cmd_submit(args: argparse.Namespace) -> int:
    if args.submit_command is None:
        raise UsageError("submit needs a scheduler: slurm, sagemaker")
    return _slurm(args) if args.submit_command == "slurm" else _sagemaker(args)


def _slurm(args: argparse.Namespace) -> int:
    from neurontrain.launch.slurm import SlurmJob, render_sbatch, submit

    if args.nodes < 1 or args.nproc_per_node < 1:
        raise UsageError("--nodes and --nproc-per-node must be at least 1")
    if args.max_restarts < 0:
        raise UsageError("--max-restarts must be 0 or more")
    recipe = _validated(args, args.nodes * args.nproc_per_node, args.backend)
    output_dir = Path(args.output_dir or Path("runs") / recipe.name).resolve()
    job = SlurmJob(Path(args.recipe).resolve(), output_dir, args.nodes, args.nproc_per_node, args.python,
                   _job_name(args, recipe.name), list(args.overrides), args.backend, args.partition, args.time_limit,
                   args.account, args.max_restarts, args.master_port, _cache_url(args, recipe)).validate()
    output_dir.mkdir(parents=True, exist_ok=True)  # Slurm does not create the --output directory
    script = Path(args.script) if args.script else output_dir / f"{job.job_name}.sbatch"
    script.write_text(render_sbatch(job))
    script.chmod(0o755)
    result = {"script": str(script), "nodes": job.nodes, "workers": job.nodes * job.nproc_per_node}
    if args.submit:
        result["job_id"] = submit(script)
        result["log"] = str(output_dir / f"slurm-{result['job_id']}.out")
    print(json.dumps(result))
    return 0


def _sagemaker(args: argparse.Namespace) -> int:
    from neurontrain.launch.sagemaker import NEURONCORES, SageMakerJob, submit, training_job_request

    if args.instance_count < 1:
        raise UsageError("--instance-count must be at least 1")
    if args.max_run < 1 or args.volume_size < 1:
        raise UsageError("--max-run and --volume-size must be positive")
    cores = NEURONCORES.get(args.instance_type, 1)
    recipe = _validated(args, args.instance_count * cores)
    region = args.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not region:
        import boto3

        region = boto3.session.Session().region_name
    if not region:
        raise UsageError("no AWS region: pass --region or set AWS_REGION")
    job = SageMakerJob(recipe.model_dump(mode="json"), args.role, args.instance_type, args.instance_count, args.output,
                       region, _job_name(args, recipe.name), args.image, args.max_run, args.volume_size,
                       _cache_url(args, recipe)).validate()
    if args.dry_run:
        print(json.dumps(training_job_request(job), indent=2))
        return 0
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    try:
        result = submit(job, boto3.client("sagemaker", region_name=region), boto3.client("s3", region_name=region))
    except NoCredentialsError:
        raise UsageError("no AWS credentials found (environment, ~/.aws or an instance role)") from None
    except ClientError as exc:
        err = exc.response.get("Error", {})
        raise NeurontrainError(f"SageMaker/S3 refused the job: {err.get('Code', '?')}: {err.get('Message', '')}") from None
    except BotoCoreError as exc:
        raise NeurontrainError(f"cannot reach AWS: {exc}") from None
    print(json.dumps(result))
    return 0
