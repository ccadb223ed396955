"""How many workers there are and where they meet: pure logic, no torch.

The same `Topology` turns into torchrun's own arguments (`torchrun_args`), for `run` on this node and for the
SLURM script, so what `neurontrain run --nproc-per-node N` does is what torchrun does with those flags.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from neurontrain.errors import UsageError

_HOST = re.compile(r"^[A-Za-z0-9_.:\-\[\]$%{}]+$")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """torchrun's topology; a bad value is a one-line UsageError naming its flag."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    max_restarts: int = 0
    rdzv_endpoint: str | None = None  # host:port of a c10d rendezvous (multi-node, elastic); else static
    rdzv_id: str | None = None
    rdzv_timeout: int = 900  # seconds to wait for every node to join

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes

    def __post_init__(self) -> None:
        for name in ("nproc_per_node", "nnodes"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} must be between 0 and --nnodes - 1 ({self.nnodes - 1})")
        if self.max_restarts < 0:
            raise UsageError("--max-restarts must be 0 or more")
        if not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port {self.master_port} is not a TCP port (1-65535)")
        if self.rdzv_timeout < 1:
            raise UsageError("--rdzv-timeout must be at least 1 second")
        if not _HOST.match(self.master_addr):
            raise UsageError(f"--master-addr {self.master_addr!r} is not a host name or address")
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UsageError(f"--rdzv-endpoint {self.rdzv_endpoint!r} must be HOST:PORT")
            if self.rdzv_id is None:
                raise UsageError("--rdzv-endpoint needs --rdzv-id (the same on every node, e.g. $SLURM_JOB_ID)")


def torchrun_args(topology: Topology) -> list[str]:
    """torchrun's flags for this topology (without the program to run).

    One node: a standalone c10d rendezvous on a free local port. Several nodes: a c10d rendezvous at
    --rdzv-endpoint when given (node ranks assigned on arrival, restarts across nodes), else a static one at
    --master-addr:--master-port with this node's --node-rank.
    """
    t = topology
    args = [f"--nproc-per-node={t.nproc_per_node}", f"--max-restarts={t.max_restarts}"]
    if t.nnodes == 1 and t.rdzv_endpoint is None:
        return ["--standalone", "--nnodes=1"] + args
    args.insert(0, f"--nnodes={t.nnodes}")
    if t.rdzv_endpoint is not None:
        return args + [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={t.rdzv_endpoint}",
            f"--rdzv-id={t.rdzv_id}",
            f"--rdzv-conf=join_timeout={t.rdzv_timeout}",
        ]
    return args + [
        "--rdzv-backend=static",
        f"--node-rank={t.node_rank}",
        f"--master-addr={t.master_addr}",
        f"--master-port={t.master_port}",
        f"--rdzv-conf=timeout={t.rdzv_timeout}",
    ]
