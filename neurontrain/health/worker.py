"""One health-check worker, started by torchrun: device sanity, then all-reduce / all-gather / reduce-scatter
over a sweep of sizes with a correctness check on rank-dependent data and nccom-test style timing.

Progress goes to <work dir>/rank<R>.json at the start and end of every check; the coordinator
(health/runner.py) reads it together with the process state in /proc (stopped, gone).

    python -m torch.distributed.run --nproc-per-node 2 -m neurontrain.health.worker --work-dir D ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from neurontrain.backends import select_backend
from neurontrain.errors import first_line
from neurontrain.fileio import write_json_atomic
from neurontrain.health.parsers import OPS, bandwidths
from neurontrain.logs import process_rank


class Reporter:
    def __init__(self, work_dir: Path, rank: int) -> None:
        self.path = work_dir / f"rank{rank}.json"
        self.state = {
            "rank": rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "state": "running",
            "started_at": time.time(),
            "current": None,
            "results": [],
        }
        self.write()
        signal.signal(signal.SIGTERM, self._terminated)

    def _terminated(self, signum, frame) -> None:
        """The launcher stops the remaining workers when one fails: record it, so this rank is not blamed."""
        if self.state["state"] == "running":
            self.state["state"] = "terminated"
            self.write()
        os._exit(143)

    def write(self) -> None:
        write_json_atomic(self.path, self.state, indent=None)

    def start(self, check: str) -> None:
        self.state["current"] = {"check": check, "started": time.time()}
        self.write()

    def finish(self, result: dict) -> None:
        result["finished_at"] = round(time.time(), 3)
        self.state["results"].append(result)
        self.state["last_check"] = result["check"]
        self.state["current"] = None
        self.write()


def device_checks(
    backend, expect_devices: int | None, reporter: Reporter | None = None, *, compiler: bool = False
) -> list[dict]:
    """Operations with known results on the device, checked against CPU, and the device count; with `compiler`,
    on native, a compile through the native backend's compiler too (`health` checks it; preflight leaves it to
    the run, which compiles the model next)."""
    device = backend.device
    gen = torch.Generator().manual_seed(1234)
    a, b = torch.randn(128, 128, generator=gen), torch.randn(128, 128, generator=gen)

    def matmul():
        got = (a.to(device) @ b.to(device)).cpu()
        err = (got - a @ b).abs().max().item()
        return err < 1e-3, f"matmul differs from CPU by {err:.3g}"

    def reductions():
        x = a.to(device)
        got = torch.stack([x.sum(), x.max(), x.min(), x.abs().mean()]).cpu()
        want = torch.stack([a.sum(), a.max(), a.min(), a.abs().mean()])
        err = (got - want).abs().max().item()
        return err < 1e-3, f"reductions differ from CPU by {err:.3g}"

    def bf16():
        x, y = a.to(torch.bfloat16), b.to(torch.bfloat16)
        got = (x.to(device) * y.to(device) + x.to(device)).cpu()
        want = x * y + x
        return torch.equal(got, want), "bf16 multiply-add differs from CPU"

    def count():
        found = backend.device_count()
        return found == expect_devices, f"expected {expect_devices} devices per worker, found {found}"

    checks = [("device matmul", matmul), ("device reductions", reductions), ("device bf16", bf16)]
    if compiler and backend.compiler is not None:
        checks.append(("device compile", lambda: compile_check(backend, a, b)))
    if expect_devices is not None:
        checks.append(("device count", count))
    return [_run_check(name, fn, reporter) for name, fn in checks]


def _run_check(name: str, fn: Callable[[], tuple[bool, str]], reporter: Reporter | None) -> dict:
    if reporter:
        reporter.start(name)
    t0 = time.perf_counter()
    try:
        ok, problem = fn()
    except Exception as exc:  # a device that cannot run the op is a failed check, named
        ok, problem = False, f"{type(exc).__name__}: {first_line(exc)}"
    result = {"check": name, "ok": ok, "seconds": round(time.perf_counter() - t0, 4)}
    if not ok:
        result["problem"] = problem
    if reporter:
        reporter.finish(result)
    return result


def compile_check(backend, a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    """The native backend's compiler (inductor here, `neuron` on TorchNeuron) compiles a small function whose
    result matches eager on the CPU: a missing C++ compiler or a broken compiler install fails here, named."""
    device = backend.device

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ y) * 0.5 + x.sum(dim=0)

    got = torch.compile(fn, backend=backend.compiler, dynamic=False)(a.to(device), b.to(device)).cpu()
    err = (got - fn(a, b)).abs().max().item()
    return err < 1e-3, f"compiled function differs from eager on the CPU by {err:.3g}"


def expected_pattern(numel: int, rank: int, dtype):
    return (torch.arange(numel, dtype=torch.int64) % 7 + 1).to(dtype) * (rank + 1)


def _collective(
    op: str, numel: int, rank: int, world: int, device: torch.device
) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """(a call that runs the collective once on this rank's known input on `device`, the result it must return,
    on the CPU)."""
    x = expected_pattern(numel, rank, torch.float32).to(device)
    reduced = expected_pattern(numel, 0, torch.float32) * (world * (world + 1) // 2)
    if op == "all_reduce":

        def all_reduce() -> torch.Tensor:
            buf = x.clone()
            dist.all_reduce(buf)
            return buf

        return all_reduce, reduced
    if op == "all_gather":
        gathered = torch.empty(numel * world, device=device)
        want = torch.cat([expected_pattern(numel, r, torch.float32) for r in range(world)])
        return lambda: (dist.all_gather_into_tensor(gathered, x), gathered)[1], want
    scattered = torch.empty(numel // world, device=device)
    return lambda: (dist.reduce_scatter_tensor(scattered, x), scattered)[1], reduced.chunk(world)[rank]


def _wait_for(device: torch.device) -> None:
    """Collectives on an accelerator return before they finish: wait before reading the clock."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _timed_check(name: str, op: str, nbytes: int, world: int, iters: int, warmup: int, device: torch.device) -> dict:
    run, want = _collective(op, nbytes // 4, dist.get_rank(), world, device)
    got = run().cpu()
    ok = torch.equal(got, want)
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        _wait_for(device)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    size_bytes = nbytes * world if op == "all_gather" else nbytes
    algbw, busbw = bandwidths(op, world, size_bytes, seconds)
    result = {
        "check": name,
        "op": op,
        "size_bytes": size_bytes,
        "ok": ok,
        "time_us": round(seconds * 1e6, 1),
        "algbw_gibps": round(algbw, 4),
        "busbw_gibps": round(busbw, 4),
    }
    if not ok:
        bad = (got - want).abs()
        result["problem"] = (
            f"wrong result: {int((bad > 0).sum())} of {bad.numel()} elements differ (max {bad.max().item():.3g})"
        )
    return result


def collective_checks(
    reporter: Reporter, sizes: list[int], iters: int, warmup: int, device: torch.device | None = None
) -> bool:
    """Each collective at each size on tensors on `device` (default: the host, as gloo takes them)."""
    device = device or torch.device("cpu")
    world = dist.get_world_size()
    ok_all = True
    for op in OPS:
        for size in sizes:
            nbytes = max(world, size // 4 // world * world) * 4
            name = f"{op} {nbytes}B"
            reporter.start(name)
            try:
                result = _timed_check(name, op, nbytes, world, iters, warmup, device)
            except Exception as exc:
                reporter.state["state"] = "failed"
                reporter.state["error"] = f"{type(exc).__name__}: {first_line(exc)}"
                reporter.finish({"check": name, "op": op, "ok": False, "error": reporter.state["error"]})
                return False
            ok_all &= result["ok"]
            reporter.finish(result)
    return ok_all


def node_device_check(argv: list[str] | None = None) -> int:
    """`python -m neurontrain.health.worker --node-device OUT.json`: the device checks of a node whose workers
    share one device (the host CPU), run once, beside the workers rather than in each of them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--node-device", required=True)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--expect-devices", type=int)
    args, _ = parser.parse_known_args(argv)
    started = time.time()
    results = device_checks(select_backend(args.backend), args.expect_devices, compiler=True)
    for r in results:
        r["finished_at"] = round(time.time(), 3)
    out = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": started, "results": results}
    Path(args.node_device).write_text(json.dumps(out))
    return 0 if all(r["ok"] for r in results) else 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--sizes", default="1024,65536,1048576")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--expect-devices", type=int)
    parser.add_argument("--skip-device", action="store_true")
    args = parser.parse_args(argv)
    rank = process_rank()
    reporter = Reporter(Path(args.work_dir), rank)
    ok = True
    backend = select_backend(args.backend)
    # The process group first, then the device: TorchNeuron's `neuron` group assigns this worker its cores
    # (NEURON_RT_VISIBLE_CORES from LOCAL_RANK) and refuses a runtime already started; a device touched before
    # it would start the runtime on every core. native: the device's own process-group backend on device
    # tensors (gloo on the CPU); the XLA backends' host-side gloo group otherwise, as their training uses it.
    reporter.start("rendezvous")
    dist.init_process_group(backend.process_group, timeout=timedelta(seconds=args.timeout))
    reporter.finish({"check": "rendezvous", "ok": True})
    device = backend.device if backend.collectives_on_device else None
    if args.skip_device:
        reporter.state["device"] = "the host CPU, shared by all local workers: checked once by the coordinator"
    else:
        ok &= all(r["ok"] for r in device_checks(backend, args.expect_devices, reporter, compiler=True))
    sizes = [int(s) for s in args.sizes.split(",")]
    ok &= collective_checks(reporter, sizes, args.iters, args.warmup, device)
    if reporter.state["state"] != "failed":
        reporter.state["state"] = "done"
        reporter.write()
        dist.destroy_process_group()
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(node_device_check() if "--node-device" in sys.argv else main())
