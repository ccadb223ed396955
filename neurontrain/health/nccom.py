"""The nccom-test command line, as the NCCOM-TEST user guide prescribes it (pure).

One node: `nccom-test -r RANKS ... OP --check`. Several nodes: one invocation, from node 0, runs the benchmark
on every node: either MPI mode (`--hosts H0 H1 ...` with NEURON_RT_ROOT_COMM_ID set to the first host's IP
address and a free port) or Slurm mode (`--slurm-mode --slurm-job-id JOB`, on the job's own allocation). The
other nodes run no nccom-test of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neurontrain.errors import UsageError
from neurontrain.health.parsers import NCCOM_OP

STEP_FACTOR = 4


@dataclass(frozen=True)
class NccomMode:
    kind: str  # "single", "mpi", "slurm" or "skip" (not node 0)
    hosts: list[str] = field(default_factory=list)
    root_comm_id: str | None = None  # MPI mode: first host's IP:port
    slurm_job: str | None = None


def nccom_mode(
    nnodes: int, node_rank: int, hosts: list[str] | None, master_addr: str, slurm_job: str | None
) -> NccomMode:
    """How this node runs nccom-test; a multi-node run without a way to reach the other nodes is bad input."""
    if nnodes == 1:
        return NccomMode("single")
    if node_rank != 0:
        return NccomMode("skip")
    if hosts:
        if len(hosts) != nnodes:
            raise UsageError(f"--hosts lists {len(hosts)} hosts for --nnodes {nnodes}")
        if hosts[0] != master_addr:
            raise UsageError(f"--hosts must start with node 0, the --master-addr {master_addr} (got {hosts[0]})")
        return NccomMode("mpi", list(hosts))
    if slurm_job:
        return NccomMode("slurm", slurm_job=slurm_job)
    raise UsageError(
        f"nccom-test across {nnodes} nodes runs once, from node 0, through MPI or Slurm: pass --hosts "
        "NODE0,NODE1,... or run inside a Slurm allocation (SLURM_JOB_ID)"
    )


def with_root_comm(mode: NccomMode, first_host_ip: str, port: int) -> NccomMode:
    return NccomMode(mode.kind, mode.hosts, f"{first_host_ip}:{port}", mode.slurm_job)


def nccom_command(
    op: str, ranks: int, nnodes: int, sizes: list[int], iters: int, mode: NccomMode
) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) for one collective; `--check` last (newer releases take an optional value)."""
    cmd = ["nccom-test", "-r", str(ranks)]
    if nnodes > 1:
        cmd += ["-N", str(nnodes)]
    cmd += [
        "-b",
        str(min(sizes)),
        "-e",
        str(max(sizes)),
        "-f",
        str(STEP_FACTOR),
        "-d",
        "fp32",
        "-n",
        str(iters),
        NCCOM_OP[op],
    ]
    env: dict[str, str] = {}
    if mode.kind == "mpi":
        cmd += ["--hosts", *mode.hosts]
        if mode.root_comm_id is None:
            raise ValueError("MPI mode needs the root communicator address")
        env["NEURON_RT_ROOT_COMM_ID"] = mode.root_comm_id
    elif mode.kind == "slurm":
        cmd += ["--slurm-mode", "--slurm-job-id", str(mode.slurm_job)]
    elif mode.kind == "skip":
        raise ValueError("nodes other than node 0 run no nccom-test")
    return cmd + ["--check"], env


def expected_sizes(sizes: list[int]) -> list[int]:
    """The sizes nccom-test visits from -b to -e by the step factor."""
    out, size = [], min(sizes)
    while size <= max(sizes):
        out.append(size)
        size *= STEP_FACTOR
    return out
