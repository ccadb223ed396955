"""`neurontrain submit slurm`: an sbatch script that starts one `neurontrain run` (torchrun agent) per node.

The nodes meet at a static rendezvous: node rank = $SLURM_NODEID, master = the job's first host (Slurm's node 0),
as in AWS's Neuron training scripts. So global rank 0 runs on the first host by construction, and the Neuron
runtime's root communicator (NEURON_RT_ROOT_COMM_ID) is pinned to that same host. (A c10d rendezvous hands out
node ranks by sorting the agents' ids, so its rank 0 can land on any node.)

Every node also raises its open-file limit, keeps the root-communicator port out of the ephemeral port range,
gets all its CPUs for the one task (srun no longer inherits --cpus-per-task), writes its own log, and keeps a
node-local compile cache (NEURONTRAIN_CACHE_DIR) that `run` fills from --compile-cache before training.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from neurontrain.errors import NeurontrainError, UsageError
from neurontrain.launch.instances import Trainium

ROOT_COMM_PORT = 41000  # the Neuron root communicator's port on the first host, as in AWS's scripts
OPEN_FILES = 65535
NODE_CACHE_DIR = "/var/tmp/neurontrain-cache"
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(,[A-Za-z0-9_.\-]+)*$")


@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    output_dir: Path  # absolute, on the shared file system: Slurm's log and the node logs go here
    run_argv: list[str]  # `neurontrain run`'s worker arguments (recipe first), as `run` itself parses them
    nodes: int
    instance: Trainium
    python: str  # interpreter with neurontrain installed, as seen from the nodes
    job_name: str
    nproc_per_node: int | None = None  # default: the instance's workers
    partition: str | None = None
    time_limit: str | None = None
    account: str | None = None
    max_restarts: int = 0
    master_port: int = 29500
    node_cache_dir: str = NODE_CACHE_DIR
    extra_env: dict[str, str] = field(default_factory=dict)
    data_nodes: int = 0  # a heterogeneous job: the first data_nodes hosts make the batches (Ray), the rest train

    @property
    def workers_per_node(self) -> int:
        return self.nproc_per_node or self.instance.workers

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.workers_per_node < 1:
            raise UsageError("--nodes and --nproc-per-node must be at least 1")
        if self.data_nodes < 0:
            raise UsageError("--data-nodes must be 0 or more")
        if self.max_restarts < 0:
            raise UsageError("--max-restarts must be 0 or more")
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.job_name):
            raise UsageError(f"--job-name {self.job_name!r}: use letters, digits, '.', '_' and '-'")
        if self.time_limit is not None and not re.fullmatch(r"[0-9:\-]+", self.time_limit):
            raise UsageError(f"--time {self.time_limit!r} is not a Slurm time (e.g. 2:00:00 or 1-00:00:00)")
        for flag, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None and not _SLURM_NAME.match(value):
                raise UsageError(
                    f"{flag} {value!r} is not a Slurm name (letters, digits, '.', '_', '-'; "
                    "partitions may be a comma-separated list)"
                )
        if not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port {self.master_port} is not a TCP port")
        if self.master_port == ROOT_COMM_PORT:
            raise UsageError(
                f"--master-port {ROOT_COMM_PORT} is the Neuron root communicator's port on the first "
                "host; choose another"
            )
        if re.search(r'["%\n]', str(self.output_dir)):
            raise UsageError(f"--output-dir {str(self.output_dir)!r}: Slurm cannot take '\"', '%' or a newline there")
        if not self.node_cache_dir.startswith("/"):
            raise UsageError(f"--node-cache-dir {self.node_cache_dir!r} must be an absolute path on the nodes")


def _header(job: SlurmJob) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes + job.data_nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        f'#SBATCH --output="{job.output_dir}/slurm-%j.out"',
    ]
    lines += [
        f"#SBATCH --{key}={value}"
        for key, value in (("partition", job.partition), ("time", job.time_limit), ("account", job.account))
        if value
    ]
    return lines


def _run_lines(job: SlurmJob, start: str) -> list[str]:
    """`start` and `run`'s worker arguments, one line per option (the recipe on the first)."""
    q = shlex.quote
    run = [start]
    for word in job.run_argv:  # one line per option, the recipe on the first
        if word.startswith("--"):
            run.append(q(word))
        else:
            run[-1] += f" {q(word)}"
    return run


def _node_function(job: SlurmJob) -> list[str]:
    """What srun runs once on every node (an exported bash function: the environment carries it)."""
    if job.data_nodes:
        run = _run_lines(job, 'exec "$PYTHON" -m neurontrain.launch.ray_node "$SLURMD_NODENAME" -- run')
        run += [
            f"--launcher=ray --nnodes={job.nodes} --nproc-per-node={job.workers_per_node}",
            f"--max-restarts={job.max_restarts}",
        ]
    else:
        run = _run_lines(job, 'exec "$PYTHON" -m neurontrain run')
        run += [
            f'--nnodes="$SLURM_JOB_NUM_NODES" --node-rank="$SLURM_NODEID" --nproc-per-node={job.workers_per_node}',
            f'--master-addr="$MASTER_ADDR" --master-port={job.master_port}',
            f"--max-restarts={job.max_restarts}",
        ]
    return [
        "neurontrain_node() {",
        f'  ulimit -n {OPEN_FILES} 2>/dev/null || ulimit -n "$(ulimit -Hn)"',
        "  # keep the root communicator's port out of the ephemeral range (added to what is reserved already)",
        "  local reserved; reserved=$(cat /proc/sys/net/ipv4/ip_local_reserved_ports 2>/dev/null || true)",
        f'  case ",$reserved," in *",{ROOT_COMM_PORT},"*) ;; *)',
        f'    local want="${{reserved:+$reserved,}}{ROOT_COMM_PORT}"',
        '    sysctl -q -w net.ipv4.ip_local_reserved_ports="$want" 2>/dev/null \\',
        '      || sudo -n sysctl -q -w net.ipv4.ip_local_reserved_ports="$want" 2>/dev/null \\',
        f'      || echo "neurontrain: warning: could not reserve port {ROOT_COMM_PORT} on $(hostname)" >&2;;',
        "  esac",
        '  mkdir -p "$NEURONTRAIN_CACHE_DIR"',
        "  " + " \\\n    ".join(run),
        "}",
        "export -f neurontrain_node",
    ]


def _ray_lines(job: SlurmJob) -> list[str]:
    """A heterogeneous job's hosts (the first data_nodes make batches; Ray's head on the first), and Ray's token
    authentication with a token of this job's own in the shared output directory (a Slurm cluster's network is
    shared with other users' jobs)."""
    token = f"{job.output_dir}/.ray-auth-token-$SLURM_JOB_ID"
    return [
        "",
        f"# The first {job.data_nodes} host(s) make the batches (Ray head on the first), the other {job.nodes} train.",
        'hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'export NEURONTRAIN_DATA_HOSTS=$(echo "$hosts" | head -n {job.data_nodes} | paste -sd, -)',
        f'export NEURONTRAIN_TRAINIUM_HOSTS=$(echo "$hosts" | tail -n +{job.data_nodes + 1} | paste -sd, -)',
        'export NEURONTRAIN_HEAD_ADDRESS="$MASTER_ADDR"',
        f'(umask 077 && "${{NEURONTRAIN_PYTHON:-{shlex.quote(job.python)}}}" -c '
        f"'import secrets; print(secrets.token_hex(32))' > \"{token}\")",
        f'export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="{token}"',
    ]


def render_sbatch(job: SlurmJob) -> str:
    q = shlex.quote
    env = {
        **job.instance.environment(job.nodes),
        "MALLOC_ARENA_MAX": "64",
        "NEURONTRAIN_CACHE_DIR": job.node_cache_dir,
        **job.extra_env,
    }
    lines = _header(job) + [
        f"# Written by `neurontrain submit slurm` ({job.instance.name}, {job.workers_per_node} workers a node).",
        "set -euo pipefail",
        "",
        "# Node 0 of the job is the first host of its node list and the static rendezvous' node rank 0: rank 0 and",
        "# the Neuron root communicator are on that host by construction. Its address is Slurm's NodeAddr.",
        'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'MASTER_ADDR=$(sinfo -h -N -n "$first_node" -o %o 2>/dev/null | head -n 1 || true)',
        "export MASTER_ADDR=${MASTER_ADDR:-$first_node}",
        f'export NEURON_RT_ROOT_COMM_ID="$MASTER_ADDR:{ROOT_COMM_PORT}"',
    ]
    lines += [f"export {key}={q(value)}" for key, value in env.items()]
    lines += _ray_lines(job) if job.data_nodes else []
    lines.append(f"export PYTHON=${{NEURONTRAIN_PYTHON:-{q(job.python)}}}")
    lines += [""] + _node_function(job)
    logs = job.output_dir / "logs"
    lines += [
        "",
        f'mkdir -p {q(str(logs))}/"$SLURM_JOB_ID"',
        f'echo "neurontrain: node logs in {logs}/$SLURM_JOB_ID/node-<N>.log; '
        + ("Ray head and driver" if job.data_nodes else "rank 0")
        + ' on $first_node ($MASTER_ADDR)"',
        'srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" \\',
        f"    --output={q(str(logs))}/%j/node-%n.log bash -c neurontrain_node",
        "",
    ]
    return "\n".join(lines)


def submit(script: Path) -> str:
    """sbatch the script; returns the job id."""
    try:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise UsageError(
            f"sbatch not found on PATH: run on a Slurm login node, or leave out --submit and sbatch {script} there"
        ) from None
    if done.returncode != 0:
        first = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[0]
        raise NeurontrainError(f"sbatch failed: {first}")
    return done.stdout.strip().split(";")[0]
