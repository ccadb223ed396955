"""`neurontrain submit slurm`: an sbatch script that starts one `neurontrain run` (torchrun agent) per node.

The workers of all nodes meet at a c10d rendezvous on the job's first node (port --master-port), with the job
id as rendezvous id, so torchrun can restart the group (--max-restarts) across nodes.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from neurontrain.errors import NeurontrainError, UsageError

# Neuron runtime and EFA settings for multi-node trn1/trn2 jobs (Neuron documentation and examples): EFA as
# the libfabric provider with device RDMA, fork safety (data loader workers), the Neuron collectives'
# bootstrap address on the first node, and a bounded number of malloc arenas.
NEURON_EFA_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "MALLOC_ARENA_MAX": "64",
}
NEURON_ROOT_COMM_PORT = 41000


@dataclass(frozen=True)
class SlurmJob:
    recipe: Path                   # absolute: nodes read it from the shared file system
    output_dir: Path
    nodes: int
    nproc_per_node: int
    python: str                    # interpreter with neurontrain installed, as seen from the nodes
    job_name: str
    overrides: list[str] = field(default_factory=list)
    backend: str | None = None
    partition: str | None = None
    time_limit: str | None = None
    account: str | None = None
    max_restarts: int = 0
    master_port: int = 29500
    compile_cache: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    def validate(self) -> "SlurmJob":
        if self.nodes < 1 or self.nproc_per_node < 1:
            raise UsageError("--nodes and --nproc-per-node must be at least 1")
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.job_name):
            raise UsageError(f"--job-name {self.job_name!r}: use letters, digits, '.', '_' and '-'")
        if self.time_limit is not None and not re.fullmatch(r"[0-9:\-]+", self.time_limit):
            raise UsageError(f"--time {self.time_limit!r} is not a Slurm time (e.g. 2:00:00 or 1-00:00:00)")
        if not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port {self.master_port} is not a TCP port")
        return self


def render_sbatch(job: SlurmJob) -> str:
    q = shlex.quote
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job.job_name}", f"#SBATCH --nodes={job.nodes}",
             "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive",
             f"#SBATCH --output={job.output_dir}/slurm-%j.out"]
    lines += [f"#SBATCH --{key}={value}" for key, value in
              (("partition", job.partition), ("time", job.time_limit), ("account", job.account)) if value]
    lines += [
        "# Written by `neurontrain submit slurm`: one torchrun agent per node, workers meet on the first node.",
        "set -euo pipefail",
        "",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export NEURON_RT_ROOT_COMM_ID=\"${{head_node}}:{NEURON_ROOT_COMM_PORT}\"",
    ]
    env = dict(NEURON_EFA_ENV)
    if job.compile_cache:
        env["NEURON_COMPILE_CACHE_URL"] = job.compile_cache
    env.update(job.extra_env)
    lines += [f"export {key}={q(value)}" for key, value in env.items()]
    lines.append(f"PYTHON=${{NEURONTRAIN_PYTHON:-{q(job.python)}}}")
    run = [f'srun --kill-on-bad-exit=1 "$PYTHON" -m neurontrain run {q(str(job.recipe))}',
           f"--output-dir {q(str(job.output_dir))}",
           f'--nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={job.nproc_per_node}',
           f'--rdzv-endpoint="${{head_node}}:{job.master_port}" --rdzv-id="$SLURM_JOB_ID"',
           f"--max-restarts={job.max_restarts}"]
    if job.backend:
        run.append(f"--backend {q(job.backend)}")
    run += [f"--set {q(expr)}" for expr in job.overrides]
    lines += ["", " \\\n    ".join(run), ""]
    return "\n".join(lines)


def submit(script: Path) -> str:
    """sbatch the script; returns the job id."""
    try:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise UsageError("sbatch not found on PATH: run on a Slurm login node, or leave out --submit and "
                         f"sbatch {script} there") from None
    if done.returncode != 0:
        first = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[0]
        raise NeurontrainError(f"sbatch failed: {first}")
    return done.stdout.strip().split(";")[0]
