"""Inside an AWS Batch multi-node job: what each node's container runs (`python -m neurontrain.launch.batch_entry`,
started by the bootstrap of `launch/batch.py`).

AWS Batch sets AWS_BATCH_JOB_NODE_INDEX, AWS_BATCH_JOB_MAIN_NODE_INDEX, AWS_BATCH_JOB_NUM_NODES,
AWS_BATCH_JOB_ATTEMPT and AWS_BATCH_JOB_ID (<job id>#<node index> on a node), and only on the children
AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS. The main node starts first, the children after it runs, in any
order; the job ends when the main node exits, and an attempt that failed there starts again on new hosts.

So each node: fetches the recipe; pulls the newest complete checkpoint of the job (S3, under the job id without
its #N) into a fresh run directory, so attempt 2 resumes where attempt 1's last checkpoint left off; takes the
main node's address from its own interface (main) or from Batch (children, which wait for the main node's
rendezvous port to open, within NEURONTRAIN_NODE_WAIT seconds, else exit 3 so the next attempt gets new hosts);
sets the Neuron root communicator on the main node; runs `neurontrain run` as one torchrun agent of a static
rendezvous (node rank: the node's index counted from the main node), whose preflight health check exits 3 on a
bad node. The main node pushes each new checkpoint to S3 while the run goes, and at the end the model, summary
and metrics.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neurontrain.errors import HealthCheckFailed, UsageError
from neurontrain.launch.batch_checkpoints import CheckpointMirror
from neurontrain.launch.instances import ec2_instance
from neurontrain.launch.sagemaker_entry import run_neurontrain
from neurontrain.launch.slurm import ROOT_COMM_PORT

_PUBLISHED = ("summary.json", "metrics.jsonl", "preflight.jsonl")


@dataclass(frozen=True)
class BatchNode:
    """This node of the job, from AWS Batch's variables (pure)."""

    index: int
    main_index: int
    nodes: int
    attempt: int
    job_id: str  # without #<node index>
    main_address: str | None  # None on the main node

    @property
    def is_main(self) -> bool:
        return self.index == self.main_index

    @property
    def node_rank(self) -> int:
        """torchrun's node rank: 0 on the main node (rank 0 and the root communicator live there)."""
        return (self.index - self.main_index) % self.nodes

    @classmethod
    def from_env(cls, env: dict[str, str]) -> BatchNode:
        try:
            values = {
                name: int(env[f"AWS_BATCH_JOB_{name.upper()}"])
                for name in ("node_index", "main_node_index", "num_nodes")
            }
            job_id = env["AWS_BATCH_JOB_ID"].partition("#")[0]
        except KeyError as exc:
            raise UsageError(f"{exc.args[0]} is not set: this runs inside an AWS Batch multi-node job") from None
        except ValueError as exc:
            raise UsageError(f"an AWS Batch job variable is not a number: {exc}") from None
        node = cls(
            index=values["node_index"],
            main_index=values["main_node_index"],
            nodes=values["num_nodes"],
            attempt=int(env.get("AWS_BATCH_JOB_ATTEMPT", "1")),
            job_id=job_id,
            main_address=env.get("AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS") or None,
        )
        if not node.is_main and node.main_address is None:
            raise UsageError("AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS is not set on a child node")
        return node


def own_address() -> str:
    """This host's address on the interface of its default route (no packet is sent), else its name's."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def wait_for_port(host: str, port: int, timeout: float) -> None:
    """Until host:port accepts a connection (the main node's rendezvous); exit 3 after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise HealthCheckFailed(
                    f"the main node {host}:{port} did not open its rendezvous within {timeout:.0f} s"
                ) from None
            time.sleep(0.5)


def run_argv(node: BatchNode, recipe_file: Path, run_dir: Path, master: str, port: int, nproc: int,
             arguments: list[str]) -> list[str]:  # fmt: skip
    return ["run", str(recipe_file), "--output-dir", str(run_dir), *arguments, "--nproc-per-node", str(nproc),
            "--nnodes", str(node.nodes), "--node-rank", str(node.node_rank), "--master-addr", master,
            "--master-port", str(port)]  # fmt: skip


def _s3_client() -> Any:
    import boto3  # lazy: the node entry is the only part of the package a Batch container starts with

    return boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None)


def _download(client: Any, url: str, target: Path) -> None:
    bucket, _, key = url[len("s3://") :].partition("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    client.download_file(bucket, key, str(target))


def publish(client: Any, run_dir: Path, url: str) -> None:
    """The final model, summary and metrics of a finished run to <url>/ (url: s3://bucket/prefix)."""
    bucket, _, prefix = url[len("s3://") :].partition("/")
    paths = [run_dir / name for name in _PUBLISHED if (run_dir / name).is_file()]
    paths += sorted(p for p in (run_dir / "model").rglob("*") if p.is_file())
    for path in paths:
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(run_dir).as_posix()}")


def init_from_url(arguments: list[str]) -> tuple[int, str] | None:
    """Pure: (position, URL) of an `--init-from s3://...` among `run`'s arguments, or None."""
    for i, word in enumerate(arguments[:-1]):
        if word == "--init-from" and arguments[i + 1].startswith("s3://"):
            return i + 1, arguments[i + 1]
    return None


def fetch_init_from(client: Any, arguments: list[str], target: Path) -> list[str]:
    """`--init-from s3://bucket/prefix` (a previous job's model, M5's incremental training) fetched into `target`
    on this node; the arguments with the local directory instead."""
    found = init_from_url(arguments)
    if found is None:
        return arguments
    position, url = found
    bucket, _, prefix = url[len("s3://") :].partition("/")
    prefix = prefix.strip("/") + "/"
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
    if not keys:
        raise UsageError(f"--init-from {url}: no objects under it")
    for key in keys:
        _download(client, f"s3://{bucket}/{key}", target / key[len(prefix) :])
    return [*arguments[:position], str(target), *arguments[position + 1 :]]


def node_environment(node: BatchNode, master: str, env: dict[str, str]) -> dict[str, str]:
    """The Neuron and EFA variables of the Slurm path: the instance type's, and the root communicator on the main
    node's address."""
    instance = ec2_instance(env.get("NEURONTRAIN_INSTANCE_TYPE", "trn1.32xlarge"), "NEURONTRAIN_INSTANCE_TYPE")
    return {**instance.environment(node.nodes), "NEURON_RT_ROOT_COMM_ID": f"{master}:{ROOT_COMM_PORT}"}


def main(env: dict[str, str] | None = None, runner: Callable[..., int] | None = None) -> int:
    env = dict(os.environ) if env is None else env
    try:
        node = BatchNode.from_env(env)
        arguments = json.loads(env.get("NEURONTRAIN_RUN_ARGS", "[]"))
        recipe_url, checkpoints = env["NEURONTRAIN_RECIPE_URL"], env["NEURONTRAIN_CHECKPOINTS"].rstrip("/")
    except (UsageError, json.JSONDecodeError, KeyError) as exc:
        message = f"{exc.args[0]} is not set" if isinstance(exc, KeyError) else str(exc)
        print(f"neurontrain: error: {message}", file=sys.stderr)
        return 2
    return _node_main(node, env, arguments, recipe_url, f"{checkpoints}/{node.job_id}", runner or run_neurontrain)


def _node_main(node: BatchNode, env: dict[str, str], arguments: list[str], recipe_url: str, job_url: str,
               runner: Callable[..., int]) -> int:  # fmt: skip
    work = Path(env.get("NEURONTRAIN_WORK_DIR", "/tmp/neurontrain-batch"))
    run_dir, client = work / "run", _s3_client()
    recipe_file = work / "recipe.json"
    _download(client, recipe_url, recipe_file)
    try:
        arguments = fetch_init_from(client, arguments, work / "init-from")
    except UsageError as exc:
        print(f"neurontrain: error: {exc}", file=sys.stderr)
        return 2
    mirror = CheckpointMirror(f"{job_url}/checkpoints", run_dir / "checkpoints", client)
    step = mirror.pull()
    where = f"resuming from step {step} ({job_url}/checkpoints)" if step is not None else "starting at step 0"
    print(f"neurontrain: job {node.job_id} attempt {node.attempt}, node {node.index} of {node.nodes}: {where}",
          file=sys.stderr, flush=True)  # fmt: skip
    port = int(env.get("NEURONTRAIN_MASTER_PORT", "29500"))
    master = own_address() if node.is_main else str(node.main_address)
    if not node.is_main:
        try:
            wait_for_port(master, port, float(env.get("NEURONTRAIN_NODE_WAIT", "600")))
        except HealthCheckFailed as exc:
            print(f"neurontrain: error: {exc}", file=sys.stderr)
            return exc.exit_code
    nproc = int(env.get("NEURONTRAIN_NPROC_PER_NODE", "1"))
    argv = run_argv(node, recipe_file, run_dir, master, port, nproc, arguments)
    if node.is_main:
        mirror.start(float(env.get("NEURONTRAIN_CHECKPOINT_PUSH_INTERVAL", "2")))
    try:
        code = runner(argv, env=node_environment(node, master, env))
    finally:
        if node.is_main:
            mirror.stop()
    if code == 0 and node.is_main:
        publish(client, run_dir, job_url)
    return code


if __name__ == "__main__":
    sys.exit(main())
