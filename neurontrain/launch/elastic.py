"""Start this node's workers through torch.distributed.run (torchrun's own argument parsing and elastic agent),
and turn a failed group into one line and an exit code."""

from __future__ import annotations

import logging
import os
import socket
import uuid

from neurontrain.errors import NeurontrainError, UsageError, first_line
from neurontrain.launch.topology import Topology, torchrun_args
from neurontrain.processes import MARKER, Marked, WorkerWatch, new_marker


class WorkersFailed(NeurontrainError):
    """A worker failed after every allowed restart; exit code: the worker's own when it was 2 or 3, else 1."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def launch(topology: Topology, worker_argv: list[str], *, script: bool = False) -> None:
    """Run `python -m neurontrain <worker_argv>` (script: `python <worker_argv>`, a user's script and its
    arguments) as topology.nproc_per_node workers of the job; returns when every worker of the group has exited
    0, restarting the group up to topology.max_restarts times."""
    # lazy: torchrun's elastic agent loads only in the process that launches workers, not in every worker
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    entry = worker_argv if script else ["--module", "neurontrain", *worker_argv]
    args = torchrun.parse_args(torchrun_args(topology) + entry)
    if args.standalone:  # as torchrun's own run() does
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if topology.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        # torchrun would set 1 (with a banner); share the node's cores among its workers instead
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // topology.nproc_per_node))
    config, cmd, cmd_args = torchrun.config_from_args(args)
    # The agent logs every restart and failure at WARNING/ERROR with tracebacks; our one-line summary is enough.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    where = topology.rdzv_endpoint or f"{topology.master_addr}:{topology.master_port}"
    marker = new_marker()  # inherited by every worker and its children: all are found and ended on return
    os.environ.update(marker)
    try:
        with WorkerWatch(marker) as watch:
            elastic_launch(config, cmd)(*cmd_args)
    except ChildFailedError as exc:
        raise _workers_failed(exc, topology, watch.first_stopped) from None
    except RendezvousError as exc:
        raise WorkersFailed(
            f"rendezvous at {where} failed within {topology.rdzv_timeout} s ({type(exc).__name__}: {first_line(exc)})",
            1,
        ) from None
    except (RuntimeError, OSError) as exc:  # e.g. DistNetworkError: the master's store cannot be reached
        raise WorkersFailed(
            f"cannot start the workers' rendezvous at {where}: {type(exc).__name__}: {first_line(exc, limit=300)}", 1
        ) from None
    finally:
        os.environ.pop(MARKER, None)


def _workers_failed(exc, topology: Topology, stopped: Marked | None) -> WorkersFailed:
    """The first failed worker, after the worker seen stopped (SIGSTOP: state T) if there was one: the others
    failed waiting on it."""
    rank, failure = root_failure(exc.failures)
    code = failure.exitcode
    how = f"was killed by {failure.signal_name()}" if code < 0 else f"exited with code {code}"
    restarts = (
        f" after {topology.max_restarts} restart{'s' if topology.max_restarts != 1 else ''}"
        if topology.max_restarts
        else ""
    )
    message = f"worker rank {rank} (pid {failure.pid}) {how}{restarts}; see its error above"
    if stopped is not None:
        message = (
            f"worker rank {stopped.rank} (pid {stopped.pid}) stopped responding first: its process was stopped "
            f"(state T, e.g. SIGSTOP); then {message}"
        )
    return WorkersFailed(message, code if code in (2, 3) else 1)


def root_failure(failures: dict) -> tuple[int, object]:
    """The failure that names the group's: the first one (torchrun's timestamps, whole seconds), except that among
    failures seen in the same second as it, a worker's own verdict (exit 2 or 3: bad input, a failed health check)
    wins over a signal or exit 1: the workers of a failed preflight all exit 3 at once, and one of them dying in
    its teardown (SIGABRT from a collective's thread) must not turn the run's exit 3 into 1."""
    first = min(failures, key=lambda r: failures[r].timestamp)
    same_moment = sorted(r for r, f in failures.items() if f.timestamp - failures[first].timestamp <= 1)
    verdicts = [r for r in same_moment if failures[r].exitcode in (2, 3)]
    rank = verdicts[0] if verdicts else first
    return rank, failures[rank]


def check_master_address(topology: Topology) -> None:
    """A master address that does not resolve is bad input (exit 2), found before any worker starts."""
    if topology.nnodes == 1 and topology.rdzv_endpoint is None:
        return
    host = topology.rdzv_endpoint.rpartition(":")[0] if topology.rdzv_endpoint else topology.master_addr
    try:
        socket.getaddrinfo(host.strip("[]"), None)
    except OSError as exc:
        raise UsageError(f"cannot resolve the master address {host!r}: {exc.strerror or exc}") from None


def in_worker() -> bool:
    """Whether this process is a worker started by torchrun (ours or the user's own)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ
