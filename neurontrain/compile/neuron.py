"""Compile discovered HLO graphs with neuronx-cc, in parallel worker processes, into the Neuron persistent
cache layout (see compile/neuron_cache.py), so torch-neuronx finds them at run time.

Only exercised here with a stand-in `neuronx-cc` that honours the real command line (tests/standin); real
NEFF compilation happens on a Neuron host.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from neurontrain.compile.neuron_cache import (canonical_flags, default_workers, entry_state, module_dir,
                                              parse_compiler_version)
from neurontrain.compile.store import run_parallel
from neurontrain.errors import UsageError

LOCK_NAME = "model.hlo_module.pb.lock"
TRANSIENT_EXIT_CODES = {137, 139, 143}  # killed (OOM killer), segfault, terminated: worth another try


@dataclass
class CompileResult:
    graph_id: str
    status: str          # cached | compiled | failed
    seconds: float
    attempts: int
    module: str
    error: str = ""


def _host_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_is_stale(lock: Path, max_age_seconds: float) -> bool:
    try:
        info = json.loads(lock.read_text())
    except (OSError, ValueError):
        info = {}
    age = time.time() - (info.get("time") or lock.stat().st_mtime)
    if age > max_age_seconds:
        return True
    return info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int) and not _pid_alive(info["pid"])


def clear_stale_locks(root: Path, max_age_seconds: float) -> list[Path]:
    cleared = []
    for lock in root.glob("neuronxcc-*/MODULE_*/*.lock"):
        if lock_is_stale(lock, max_age_seconds):
            lock.unlink(missing_ok=True)
            cleared.append(lock)
    return cleared


class NeuronCompiler:
    def __init__(self, cache_root: Path, flags: list[str], compiler: str | None = None, workers: int | None = None,
                 retries: int = 2, target: str | None = None, timeout_seconds: float = 4 * 3600,
                 lock_max_age_seconds: float = 6 * 3600) -> None:
        self.root = cache_root
        self.compiler = compiler or os.environ.get("NEURONX_CC") or shutil.which("neuronx-cc")
        if not self.compiler or not (Path(self.compiler).exists() or shutil.which(self.compiler)):
            raise UsageError("neuronx-cc not found: install the Neuron compiler (pip install neurontrain[neuron] from "
                             "the Neuron package repository) or point NEURONX_CC at it")
        self.flags = canonical_flags(flags)
        self.workers = workers or default_workers(os.cpu_count() or 1, _host_ram())
        self.retries = retries
        self.target = target or os.environ.get("NEURONTRAIN_NEURON_TARGET", "trn1")
        self.timeout = timeout_seconds
        self.lock_max_age = lock_max_age_seconds
        self.version = self._version()
        self._children: set[subprocess.Popen] = set()
        self._children_lock = threading.Lock()

    def _version(self) -> str:
        try:
            out = subprocess.run([self.compiler, "--version"], capture_output=True, text=True, timeout=120)
            return parse_compiler_version(out.stdout + out.stderr)
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            raise UsageError(f"cannot read the version of {self.compiler}: {exc}") from None

    def module(self, graph_id: str) -> Path:
        return module_dir(self.root, self.version, graph_id, self.flags)

    def compile_all(self, graphs: list[tuple[str, Path]]) -> list[CompileResult]:
        clear_stale_locks(self.root, self.lock_max_age)
        try:
            return run_parallel(self._compile_one, graphs, self.workers, "neuronx-cc", "graph")
        finally:
            self._kill_children()

    def _kill_children(self) -> None:
        with self._children_lock:
            for proc in list(self._children):
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)

    def _acquire(self, directory: Path) -> bool:
        directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(directory / LOCK_NAME, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}, fh)
        return True

    def _compile_one(self, item: tuple[str, Path]) -> CompileResult:
        graph_id, hlo = item
        directory = self.module(graph_id)
        start = time.perf_counter()
        rel = str(directory.relative_to(self.root))
        while True:
            state = entry_state(directory)
            if state == "compiled":
                return CompileResult(graph_id, "cached", 0.0, 0, rel)
            if state == "failed":
                return CompileResult(graph_id, "failed", 0.0, 0, rel, "cached as failed (see model.log)")
            if self._acquire(directory):
                break
            lock = directory / LOCK_NAME
            if lock.exists() and lock_is_stale(lock, self.lock_max_age):
                lock.unlink(missing_ok=True)
            time.sleep(0.2)  # another process is compiling this graph: wait for its result
        try:
            shutil.copyfile(hlo, directory / "model.hlo_module.pb")
            flag_list = self.flags.split() if self.flags else []
            (directory / "compile_flags.json").write_text(json.dumps(flag_list))
            attempts, error = 0, ""
            while attempts <= self.retries:
                attempts += 1
                rc = self._run(directory, flag_list)
                if rc == 0 and (directory / "model.neff").is_file() and (directory / "model.neff").stat().st_size:
                    (directory / "model.done").touch()
                    return CompileResult(graph_id, "compiled", time.perf_counter() - start, attempts, rel)
                (directory / "model.neff").unlink(missing_ok=True)
                error = f"neuronx-cc exited {rc}" if rc >= 0 else f"neuronx-cc killed by signal {-rc}"
                if rc == 0:
                    error = "neuronx-cc exited 0 without writing model.neff"
                if not (rc < 0 or rc in TRANSIENT_EXIT_CODES):
                    break
                time.sleep(min(2 ** attempts * 0.1, 5))
            return CompileResult(graph_id, "failed", time.perf_counter() - start, attempts, rel, error)
        finally:
            (directory / LOCK_NAME).unlink(missing_ok=True)

    def _run(self, directory: Path, flags: list[str]) -> int:
        cmd = [self.compiler, "compile", "--framework", "XLA", "model.hlo_module.pb", "--target", self.target,
               "--output", "model.neff", *flags]
        with open(directory / "model.log", "ab") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            proc = subprocess.Popen(cmd, cwd=directory, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            with self._children_lock:
                self._children.add(proc)
            try:
                return proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return -signal.SIGKILL
            finally:
                with self._children_lock:
                    self._children.discard(proc)
