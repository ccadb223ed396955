"""Compile extracted modules with the Neuron runtime's own parallel compile phase (the library call behind
`neuron_parallel_compile --command compile`), in a child process group that dies with its parent.

The child (`python -m neurontrain.compile.runtime_compile`) asks the kernel for SIGTERM when its parent dies
(PR_SET_PDEATHSIG) and answers SIGTERM by killing its whole process group: the runtime's compile workers and
their neuronx-cc processes. A SIGKILLed precompile therefore leaves no compiler running, and the runtime only
marks a module as failed when the compiler itself reported an error, so a rerun compiles what is missing.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from neurontrain.compile.runtime_cache import scan_modules
from neurontrain.logs import get_logger

log = get_logger(__name__)

PR_SET_PDEATHSIG = 1
HOST_MEMORY_PER_WORKER = 64 << 30  # neuron_parallel_compile's own default: one compiler per 64 GiB of host RAM


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_compile_workers(memory_bytes: int) -> int:
    """Parallel compiler processes when --workers is not given: one per 64 GiB of host memory (rounded up), as
    the public neuron_parallel_compile picks, and at least 1. A neuronx-cc process can take tens of GiB."""
    return max(1, math.ceil(memory_bytes / HOST_MEMORY_PER_WORKER))


@dataclass
class ModuleResult:
    module: str
    status: str  # cached | compiled | failed | missing
    seconds: float = 0.0
    error: str = ""


def _results(work_dir: Path, root: Path) -> dict[str, float]:
    """Seconds per module from the runtime's results file (NEURON_PARALLEL_COMPILE_DUMP_RESULTS)."""
    out: dict[str, float] = {}
    for path in work_dir.glob("neuron_parallel_compile_results_*.json"):
        report = json.loads(path.read_text()).get("compilation_report", {})
        for hlo, row in report.items():
            module = Path(hlo).parent
            try:
                out[str(module.relative_to(root.absolute()))] = float(row.get("compile_time", 0.0))
            except ValueError:
                continue
    return out


def compile_modules(
    root: Path, modules: list[str], workers: int | None = None, timeout_seconds: float = 6 * 3600
) -> list[ModuleResult]:
    """Compile every extracted module of the runtime cache at `root` that lacks a NEFF with `workers` compiler
    processes (default: `default_compile_workers` of this host); report `modules`."""
    before = scan_modules(root)
    results = {m: ModuleResult(m, "cached") for m in modules if before.get(m) == "compiled"}
    if len(results) < len(modules):
        with tempfile.TemporaryDirectory(prefix="neurontrain-compile-") as work:
            count = workers or default_compile_workers(host_memory_bytes())
            rc = _run_child(root.absolute(), Path(work), count, timeout_seconds)
            seconds = _results(Path(work), root)
        after = scan_modules(root)
        for m in modules:
            if m in results:
                continue
            state = after.get(m, "missing")
            status = {"compiled": "compiled", "failed": "failed"}.get(state, "missing")
            error = {
                "failed": "the compiler failed (see model.log in the module directory)",
                "missing": f"not compiled (module {state}; the runtime's compile phase exited {rc})",
            }.get(status, "")
            results[m] = ModuleResult(m, status, seconds.get(m, 0.0), error)
    return [results[m] for m in modules]


def _run_child(root: Path, work: Path, workers: int, timeout_seconds: float) -> int:
    cmd = [
        sys.executable,
        "-m",
        "neurontrain.compile.runtime_compile",
        str(os.getpid()),
        str(root),
        str(work),
        str(workers),
    ]
    env = {**os.environ, "NEURON_PARALLEL_COMPILE_DUMP_RESULTS": "1"}
    proc = subprocess.Popen(cmd, cwd=work, env=env, start_new_session=True, stdout=sys.stderr)
    try:
        return proc.wait(timeout=timeout_seconds)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(os.getpgrp(), signal.SIGKILL))
    if os.getppid() != parent:  # the parent died before the request took effect
        os.killpg(os.getpgrp(), signal.SIGKILL)


def _parallel_compile():
    # lazy: the Neuron runtime is an optional dependency, present only on Neuron hosts
    try:
        from libneuronxla.neuron_parallel_compile import parallel_compile
    except ImportError:
        from torch_neuronx.parallel_compile.neuron_parallel_compile import parallel_compile
    return parallel_compile


def main(argv: list[str]) -> int:
    parent, root, work, workers = int(argv[0]), argv[1], argv[2], int(argv[3])
    _die_with_parent(parent)
    from libneuronxla.neuron_cc_cache import CacheUrl  # lazy: optional Neuron runtime

    start = time.perf_counter()
    failed = _parallel_compile()(work, CacheUrl.get_cache_url(cache_dir=root), num_parallel=workers)
    seconds = time.perf_counter() - start
    log.info(f"the runtime's parallel compile ({workers} workers): {failed} failed, {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
