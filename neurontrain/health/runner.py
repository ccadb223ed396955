"""`neurontrain health`: start the workers through torchrun, watch their heartbeats under a deadline, name
the rank that hangs, dies or returns wrong data, and leave no process behind. Exit 3 on any failure.

On a Neuron host it also runs `neuron-ls --json-output`, reads the uncorrected-ECC counters from sysfs and
runs `nccom-test ... --check` for each collective (only there: the tools exist only on Neuron hosts). Across
nodes, node 0 runs one nccom-test over all of them (MPI mode with --hosts, or Slurm mode inside an allocation),
as the NCCOM-TEST guide prescribes; the other nodes run none of their own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from neurontrain.backends import resolve_backend_name
from neurontrain.backends.hosts import native_device_type
from neurontrain.errors import UsageError
from neurontrain.health.nccom import NccomMode, expected_sizes, nccom_command, nccom_mode, with_root_comm
from neurontrain.health.parsers import OPS, parse_nccom_test, parse_neuron_ls, read_ecc, verdict
from neurontrain.processes import end_marked, find_marked, new_marker, proc_state

STALL_SECONDS = 3.0  # a worker stopped (state T) this long is hung
KILL_GRACE_SECONDS = 1.0  # between SIGTERM (+ SIGCONT) and SIGKILL when the processes are ended


@dataclass(kw_only=True)
class HealthOptions:
    nproc_per_node: int = 2
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    timeout: float = 60.0
    sizes: list[int] = field(default_factory=lambda: [1024, 65536, 1048576])
    iters: int = 10
    backend: str = "auto"
    expect_devices: int | None = None
    min_busbw_gibps: float | None = None
    work_dir: Path | None = None
    neuron_tools: bool | None = None  # None: when neuron-ls is on PATH
    hosts: list[str] | None = None  # every node's address, node 0 first: nccom-test's MPI mode

    def __post_init__(self) -> None:
        for flag, value in (
            ("--nproc-per-node", self.nproc_per_node),
            ("--nnodes", self.nnodes),
            ("--iters", self.iters),
        ):
            if value < 1:
                raise UsageError(f"{flag} must be at least 1")
        if self.timeout <= 0:
            raise UsageError("--timeout must be positive")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError("--node-rank must be between 0 and --nnodes - 1")
        for size in self.sizes:
            if size < 4:
                raise UsageError(f"size {size} in --sizes is below 4 bytes")


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def nccom_plan(opts: HealthOptions) -> NccomMode:
    """How this node runs nccom-test (bad input raises before any worker starts)."""
    mode = nccom_mode(opts.nnodes, opts.node_rank, opts.hosts, opts.master_addr, os.environ.get("SLURM_JOB_ID"))
    if mode.kind != "mpi":
        return mode
    try:
        first = socket.gethostbyname(mode.hosts[0])
    except OSError as exc:
        raise UsageError(f"cannot resolve --hosts {mode.hosts[0]!r}: {exc.strerror or exc}") from None
    return with_root_comm(mode, first, _free_port(""))  # nccom-test runs here, on the first host


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _end_all(proc: subprocess.Popen, marker: dict[str, str]) -> None:
    """End torchrun and every process it started (re-parented, in their own sessions or stopped ones too)."""
    end_marked(marker, grace=KILL_GRACE_SECONDS)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _torchrun_command(opts: HealthOptions, work: Path) -> list[str]:
    """torchrun starting this node's health workers."""
    torchrun = [f"--nproc-per-node={opts.nproc_per_node}", f"--nnodes={opts.nnodes}", f"--node-rank={opts.node_rank}"]
    torchrun += [f"--master-addr={opts.master_addr}", f"--master-port={opts.master_port or _free_port()}"]
    torchrun += ["--max-restarts=0", "--monitor-interval=0.2"]
    worker = ["--work-dir", str(work), "--sizes", ",".join(map(str, opts.sizes)), "--iters", str(opts.iters)]
    worker += ["--timeout", str(opts.timeout), "--backend", opts.backend]
    if opts.expect_devices is not None:
        worker += ["--expect-devices", str(opts.expect_devices)]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun, "-m", "neurontrain.health.worker", *worker]


def _start_node_check(opts: HealthOptions, work: Path, marker: dict[str, str]) -> subprocess.Popen:
    """The one process that checks the device the node's XLA:CPU workers share (the host)."""
    cmd = [sys.executable, "-m", "neurontrain.health.worker", "--node-device", str(work / "device.json")]
    cmd += ["--backend", opts.backend]
    if opts.expect_devices is not None:
        cmd += ["--expect-devices", str(opts.expect_devices)]
    (work / "device.json").unlink(missing_ok=True)
    device_log = open(work / "device.log", "wb")
    env = {**os.environ, **marker}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=device_log, start_new_session=True, env=env)


def _start_up_report(rank: int, pid: int) -> dict:
    """A worker seen in /proc that never wrote its first heartbeat (it was still starting up)."""
    host = socket.gethostname()
    return {"rank": rank, "host": host, "pid": pid, "state": "running", "current": {"check": "start-up"}}


def _settle_states(reports: dict[int, dict], stalled: dict[int, str], timed_out: bool, local: range) -> None:
    """A worker still "running" after the watch: stalled (died, hung), dead, stopped (hung), hung at the deadline,
    or interrupted; one that waited on a peer which died, stopped or never started is not blamed."""
    running = [rank for rank, rep in reports.items() if rep.get("state") == "running"]
    for rank in running:  # done, failed (an error it raised), or terminated (stopped by the launcher) stay
        rep = reports[rank]
        state = proc_state(rep["pid"])
        if rank in stalled or state in ("", "Z", "X", "T"):
            rep["state"] = stalled.get(rank) or ("hung" if state == "T" else "died")
            rep["stopped"] = state == "T"
    culprit = any(reports[rank]["state"] != "running" for rank in running) or len(reports) < len(local)
    for rank in running:
        if reports[rank]["state"] == "running":
            reports[rank]["state"] = "hung" if timed_out and not culprit else "interrupted"


def _device_problems(device: dict | None, local: range) -> list[dict]:
    if device is None:
        return []
    where = f"node (local ranks {local.start}-{local.stop - 1})"
    return [
        {"rank": where, "host": device.get("host", "?"), "check": c["check"], "problem": c.get("problem", "failed")}
        for c in device.get("results", [])
        if not c.get("ok")
    ]


def workers_share_the_host(backend: str) -> bool:
    """XLA:CPU, eager on a CPU-only host and native on the CPU: every local worker runs on the host CPU (native
    on CUDA or TorchNeuron: each worker has its own device, checked in that worker after its process group)."""
    if backend == "native":
        return native_device_type() == "cpu"
    return backend in ("xla-cpu", "eager")


def run_health(opts: HealthOptions) -> dict:
    start = time.time()
    neuron = opts.neuron_tools or (opts.neuron_tools is None and shutil.which("neuron-ls") is not None)
    mode = nccom_plan(opts) if neuron else None
    work = Path(opts.work_dir or tempfile.mkdtemp(prefix="neurontrain-health-"))
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("rank*.json"):
        old.unlink()
    cmd = _torchrun_command(opts, work)
    # Workers on XLA:CPU share one device, the host: it is checked once, by a process started beside the
    # launcher (so its torch-xla start-up overlaps the launch). Neuron and GPU workers check their own device.
    node_check, node_marker = None, new_marker()
    if workers_share_the_host(resolve_backend_name(opts.backend)):
        cmd.append("--skip-device")
        node_check = _start_node_check(opts, work, node_marker)
    local = range(opts.node_rank * opts.nproc_per_node, (opts.node_rank + 1) * opts.nproc_per_node)
    try:
        reports, timed_out = _run_workers(cmd, work, local, start + opts.timeout)
        device = _finish_node_check(node_check, work, start + opts.timeout)
    finally:
        end_marked(node_marker, grace=KILL_GRACE_SECONDS)
    result = {
        "started_at": start,
        "world_size": opts.nproc_per_node * opts.nnodes,
        "local_ranks": list(local),
        "timeout_seconds": opts.timeout,
        "timed_out": timed_out,
        "wall_seconds": round(time.time() - start, 2),
        "ranks": reports,
        "collectives": _collective_table(reports),
        "bad_ranks": verdict({r: reports.get(r) for r in local}, local) + _device_problems(device, local),
        "node_device": device,
    }
    return _conclude(result, opts, reports, local, mode)


def _run_workers(cmd: list[str], work: Path, local: range, deadline: float) -> tuple[dict[int, dict], bool]:
    """Run torchrun's workers under the deadline; every process it started is gone when this returns."""
    marker = new_marker()  # in the environment of every process started here, to find and end them all
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **marker}
    with open(work / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        stalled, timed_out, starting = _watch(proc, work, local, deadline, marker)
        reports = {r: rep for r in local if (rep := _read(work / f"rank{r}.json"))}
        reports |= {r: _start_up_report(r, pid) for r, pid in starting.items() if r not in reports}
        _settle_states(reports, stalled, timed_out, local)
    finally:
        _end_all(proc, marker)
    return reports, timed_out


def _watch(
    proc: subprocess.Popen, work: Path, local: range, deadline: float, marker: dict[str, str]
) -> tuple[dict[int, str], bool, dict[int, int]]:
    """Follow the workers' heartbeats and process states until all are done, one died or stopped, or the
    deadline passed; returns ({rank: "died"|"hung"}, timed out, {rank: pid} of workers that never wrote a
    heartbeat but were seen starting up)."""
    stalled: dict[int, str] = {}
    stopped_since: dict[int, float] = {}
    starting: dict[int, int] = {}
    while proc.poll() is None:
        now = time.time()
        reports = {r: _read(work / f"rank{r}.json") for r in local}
        if all((rep or {}).get("state") == "done" for rep in reports.values()):
            break  # every worker finished: no need to wait for the launcher's own shutdown
        if not all(reports.values()):  # torchrun's own children, found by RANK before their first heartbeat
            starting |= {m.rank: m.pid for m in find_marked(marker) if m.rank in local and m.ppid == proc.pid}
        for rank in local:
            report = reports[rank]
            if report and report.get("state") != "running" or not report and rank not in starting:
                continue
            state = proc_state(report["pid"] if report else starting[rank])
            if state in ("", "Z", "X"):
                stalled[rank] = "died"
            elif state == "T":
                if now - stopped_since.setdefault(rank, now) > STALL_SECONDS:
                    stalled[rank] = "hung"
            else:
                stopped_since.pop(rank, None)
        if stalled:
            break
        if now > deadline:
            return stalled, True, starting
        time.sleep(0.2)
    return stalled, False, starting


def _conclude(result: dict, opts: HealthOptions, reports: dict, local: range, mode: NccomMode | None) -> dict:
    """Thresholds, the Neuron tools' checks, and the verdict."""
    bad = result["bad_ranks"]
    if opts.min_busbw_gibps is not None:
        slow = [
            c
            for c in result["collectives"]
            if c["busbw_gibps"] < opts.min_busbw_gibps and c["size_bytes"] >= max(opts.sizes)
        ]
        result["below_threshold"] = slow
    if mode is not None:
        result["neuron"] = neuron_checks(opts, result["world_size"], mode)
        bad += [
            {"rank": f"node {opts.node_rank}", "host": os.uname().nodename, "check": check, "problem": problem}
            for check, problem in result["neuron"]["problems"]
        ]
    result["ok"] = (
        not bad
        and not result.get("below_threshold")
        and result.get("neuron", {}).get("ok", True)
        and all(rep.get("state") == "done" for rep in reports.values())
        and len(reports) == len(local)
    )
    if not result["ok"] and not bad and not result.get("below_threshold"):
        result["bad_ranks"] = [
            {"rank": r, "host": "?", "check": "-", "problem": "did not finish"}
            for r in local
            if reports.get(r, {}).get("state") != "done"
        ]
    return result


def _finish_node_check(node_check: subprocess.Popen | None, work: Path, deadline: float) -> dict | None:
    if node_check is None:
        return None
    try:
        node_check.wait(timeout=max(0.1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(node_check.pid, signal.SIGKILL)
        node_check.wait()
        return {"results": [{"check": "device checks", "ok": False, "problem": "did not finish in time"}]}
    report = _read(work / "device.json")
    if report is None:
        return {
            "results": [
                {
                    "check": "device checks",
                    "ok": False,
                    "problem": f"device check process exited {node_check.returncode} without a report",
                }
            ]
        }
    return report


def _collective_table(reports: dict[int, dict]) -> list[dict]:
    """Per collective and size: the slowest rank's time (a collective is as fast as its slowest member)."""
    rows: dict[tuple, dict] = {}
    for rep in reports.values():
        for c in rep.get("results", []):
            if "time_us" not in c:
                continue
            key = (c["op"], c["size_bytes"])
            if key not in rows or c["time_us"] > rows[key]["time_us"]:
                rows[key] = {k: c[k] for k in ("op", "size_bytes", "time_us", "algbw_gibps", "busbw_gibps")}
    return [rows[k] for k in sorted(rows, key=lambda k: (OPS.index(k[0]), k[1]))]


def neuron_checks(opts: HealthOptions, world: int, mode: NccomMode) -> dict:
    """neuron-ls, ECC counters and nccom-test; `problems` lists (check, problem) for each failure."""
    out: dict = {"ok": True, "problems": []}
    try:
        ls = subprocess.run(["neuron-ls", "--json-output"], capture_output=True, text=True, timeout=opts.timeout)
        out["neuron_ls"] = parse_neuron_ls(ls.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        out["neuron_ls"] = {"error": str(exc)}
        out["problems"].append(("neuron-ls", str(exc)))
    out["ecc"] = read_ecc()
    out["problems"] += [
        ("ECC", f"{device}: {name} = {v}")
        for device, counters in out["ecc"].items()
        for name, v in counters.items()
        if v > 0
    ]
    out["nccom_test"] = {"mode": mode.kind}
    if mode.kind == "skip":
        out["nccom_test"]["note"] = "node 0 runs nccom-test across all nodes"
    for op in OPS if mode.kind != "skip" else ():
        cmd, env = nccom_command(op, world, opts.nnodes, opts.sizes, opts.iters, mode)
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout, env={**os.environ, **env})
            parsed = parse_nccom_test(res.stdout + res.stderr, expected_sizes(opts.sizes))
            parsed["exit_code"] = res.returncode
            if res.returncode != 0 and parsed["ok"]:
                parsed["ok"], parsed["failures"] = False, [f"nccom-test exited {res.returncode}"]
        except (OSError, subprocess.TimeoutExpired) as exc:
            parsed = {"ok": False, "failures": [f"{type(exc).__name__}: {exc}"]}
        parsed["command"] = " ".join([f"{k}={v}" for k, v in env.items()] + cmd)
        out["nccom_test"][op] = parsed
        if not parsed["ok"]:
            out["problems"].append((f"nccom-test {op}", parsed["failures"][0]))
    out["ok"] = not out["problems"]
    return out


def format_table(result: dict) -> str:
    lines = [f"{'collective':<16} {'size(B)':>10} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"]
    for c in result["collectives"]:
        lines.append(
            f"{c['op']:<16} {c['size_bytes']:>10} {c['time_us']:>10.1f} {c['algbw_gibps']:>12.4f} "
            f"{c['busbw_gibps']:>12.4f}"
        )
    for rank, rep in sorted(result["ranks"].items()):
        device = [c for c in rep.get("results", []) if c["check"].startswith("device")]
        lines.append(
            f"rank {rank} ({rep.get('host')}): {rep.get('state')}; device checks "
            + (f"{sum(1 for c in device if c.get('ok'))}/{len(device)} ok" if device else rep.get("device", "none"))
        )
    if result.get("node_device"):
        checks = result["node_device"].get("results", [])
        lines.append(
            f"node device ({result['node_device'].get('host', '?')}, shared by the local workers): "
            f"{sum(1 for c in checks if c.get('ok'))}/{len(checks)} checks ok"
        )
    for op, run in (result.get("neuron") or {}).get("nccom_test", {}).items():
        if isinstance(run, dict):
            lines.append(
                f"nccom-test {op}: {len(run.get('rows', []))} sizes, avg busbw {run.get('avg_busbw_gibps')} GB/s"
                f" {'ok' if run.get('ok') else 'FAILED: ' + '; '.join(run.get('failures', [])[:2])}"
            )
    for bad in result["bad_ranks"]:
        lines.append(f"BAD rank {bad['rank']} on {bad['host']}: {bad['problem']} in {bad['check']}")
    for slow in result.get("below_threshold", []):
        lines.append(f"SLOW {slow['op']} {slow['size_bytes']}B: busbw {slow['busbw_gibps']} GB/s")
    lines.append(f"health {'OK' if result['ok'] else 'FAILED'} in {result['wall_seconds']} s")
    return "\n".join(lines)
