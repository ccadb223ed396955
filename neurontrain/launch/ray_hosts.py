"""Every host's part of a heterogeneous job's Ray cluster, and its end (SageMaker's entry and Slurm's nodes).

The first data host starts the Ray head (`ray start --head --block`, node label neurontrain-role=data), waits
for every host of the job to join, runs the training driver (`neurontrain run --launcher ray` with RAY_ADDRESS
at the head), then ends the cluster: a marker on every other host (written there by a Ray task pinned to that
node) tells its entry to stop its Ray node and exit, and the head stops its own. Every other host joins with its
role and host name as labels (`ray start --address HEAD --block`) and waits for the marker; a head that is
gone without one ends it with exit 1 after `lost_head_seconds`. SageMaker bills until every host's entry has
exited: no host may wait forever.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from neurontrain.data.service import LABEL_KEY

HOST_LABEL = "neurontrain-host"
RAY_PORT = 6379  # the head's GCS port (Ray's default)
DRAIN_TIMEOUT = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"


@dataclass(frozen=True)
class HostRole:
    """This host's part in a heterogeneous job."""

    host: str
    role: str  # data or trainium
    head: str  # the first data host: Ray head and the run's driver
    data_hosts: tuple[str, ...]
    trainium_hosts: tuple[str, ...]
    head_address: str | None = None  # where the others reach the head, if not at its host name

    @property
    def is_head(self) -> bool:
        return self.host == self.head

    @property
    def reach(self) -> str:
        return self.head_address or self.head

    @property
    def hosts(self) -> tuple[str, ...]:
        return self.data_hosts + self.trainium_hosts


def marker_path(host: str) -> Path:
    """Where the head tells `host` that training ended (and with which exit code)."""
    return Path(tempfile.gettempdir()) / f"neurontrain-ray-{host}.done"


def ray_start_argv(role: HostRole, port: int, extra: list[str]) -> list[str]:
    labels = f"{LABEL_KEY}={role.role},{HOST_LABEL}={role.host}"
    where = ["--head", "--port", str(port)] if role.is_head else ["--address", f"{role.reach}:{port}"]
    return [sys.executable, "-m", "ray.scripts.scripts", "start", *where, "--labels", labels, "--block",
            "--disable-usage-stats", *extra]  # fmt: skip


def ray_start_env(env: dict[str, str]) -> dict[str, str]:
    """`ray start`'s environment: without Ray's drain on SIGTERM (up to 30 s, for Serve replicas to move),
    unless the job sets it. A node is stopped only once training has ended, so there is nothing to drain, and the
    head, which often never finishes draining, would sit out the whole timeout while the job is billed."""
    return {DRAIN_TIMEOUT: "0", **env}


def _start_ray(role: HostRole, port: int, extra: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        ray_start_argv(role, port, extra), env=ray_start_env(dict(os.environ)), start_new_session=True
    )


def _stop_ray(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """End this host's Ray node: its `ray start --block` stops its processes on SIGTERM; the group is killed
    after `grace` seconds if it has not."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def _wait_for_hosts(address: str, hosts: int, timeout: float) -> None:
    import ray  # lazy: the optional extra; the head only

    deadline = time.time() + timeout
    while True:
        try:
            ray.init(address=address, logging_level="ERROR")
            break
        except Exception:  # the head is still starting
            if time.time() > deadline:
                raise RuntimeError(f"the Ray head at {address} did not start within {timeout:.0f} s") from None
            time.sleep(2)
    try:
        while sum(1 for n in ray.nodes() if n["Alive"]) < hosts:
            if time.time() > deadline:
                raise RuntimeError(f"not every host joined the Ray cluster at {address} within {timeout:.0f} s")
            time.sleep(0.5)
    finally:
        ray.shutdown()


def _write_marker(code: int) -> str:
    """On a Ray node: the marker its entry waits for (the node's host comes from its label)."""
    import ray  # lazy: runs in a Ray worker

    host = ray.get_runtime_context().get_node_labels()[HOST_LABEL]
    marker_path(host).write_text(json.dumps({"code": code}))
    return host


def finish_cluster(address: str, head: str, code: int) -> list[str]:
    """Tell every host but the head that training ended; returns the hosts told."""
    import ray  # lazy: the optional extra; the head only
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # lazy: with ray

    ray.init(address=address, logging_level="ERROR")
    try:
        task = ray.remote(_write_marker)
        refs = [
            task.options(
                num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(code)
            for n in ray.nodes()
            if n["Alive"] and n["Labels"].get(HOST_LABEL) != head
        ]
        return sorted(ray.get(refs, timeout=120))
    finally:
        ray.shutdown()


def run_head(
    role: HostRole,
    driver: Callable[[dict[str, str]], int],
    *,
    port: int = RAY_PORT,
    ray_args: list[str] | None = None,
    join_timeout: float = 900.0,
) -> int:
    """The first data host: Ray head, wait for the hosts, the driver (given RAY_ADDRESS), then the end."""
    address = f"{role.reach}:{port}"
    proc = _start_ray(role, port, ray_args or [])
    code = 1
    try:
        _wait_for_hosts(address, len(role.hosts), join_timeout)
        code = driver({"RAY_ADDRESS": address})
    except RuntimeError as exc:
        print(f"neurontrain: error: {exc}", file=sys.stderr)
    finally:
        try:
            told = finish_cluster(address, role.head, code)
            print(f"neurontrain: Ray cluster ended on {len(told) + 1} host(s)", file=sys.stderr)
        finally:
            _stop_ray(proc)
    return code


def run_member(
    role: HostRole,
    *,
    port: int = RAY_PORT,
    ray_args: list[str] | None = None,
    join_timeout: float = 900.0,
    lost_head_seconds: float = 120.0,
    poll: float = 1.0,
) -> int:
    """Any other host: join the head, and leave when the head says training ended (its exit code: 0 when the
    marker came; the head's own exit carries the job's result) or when the head is gone without a word (1)."""
    marker = marker_path(role.host)
    marker.unlink(missing_ok=True)
    deadline = time.time() + join_timeout
    while not _reachable(role.reach, port):
        if time.time() > deadline:
            print(f"neurontrain: error: the Ray head {role.reach}:{port} never came up", file=sys.stderr)
            return 1
        time.sleep(poll)
    proc = _start_ray(role, port, ray_args or [])
    lost_since: float | None = None
    try:
        while not marker.exists():
            if proc.poll() is not None:
                print(f"neurontrain: error: this host's Ray node stopped (exit {proc.returncode})", file=sys.stderr)
                return 1
            if _reachable(role.reach, port):
                lost_since = None
            elif (lost_since := lost_since or time.time()) + lost_head_seconds < time.time():
                print(f"neurontrain: error: the Ray head {role.head} is gone and said nothing", file=sys.stderr)
                return 1
            time.sleep(poll)
        return 0
    finally:
        _stop_ray(proc)
        marker.unlink(missing_ok=True)
