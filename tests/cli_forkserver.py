"""A fork server for the `python -m neurontrain ...` processes the tests start.

The suite starts a few hundred CLI processes, and each fresh one pays about 5 s of CPU importing torch, torch-xla
and transformers before it does anything. The server is
one Python process per pytest worker that has imported them, and nothing more: it never touches a device, so the
XLA runtime is not started (checked before every fork). For each request it forks a child that takes the
request's environment, working directory, open-files limit and standard streams, and then runs
`python -m neurontrain ARGS` the way the interpreter does (`runpy`, `__main__`, a normal interpreter exit with
atexit handlers and non-daemon threads joined). Every child is a process of its own: its exit code, signals and
the processes it starts are as a fresh one's.

A request whose environment differs from the server's in anything read at import time (Python's paths,
OpenMP/XLA/torch/Hugging Face settings) cannot be served by a process that imported already, so the client starts
those as fresh processes (`can_fork`): the stand-in runtimes and blockers that tests put on PYTHONPATH always get
a fresh interpreter.

Experimental, off unless NEURONTRAIN_TEST_FORK_SERVER=1 (tests/conftest.py): with it, the suite was no faster from
a clean clone, and test_precompile's checks that a run compiles only what precompile found failed once (a forked
run compiled a train graph its forked precompile had not). Not understood yet.

Server usage: python cli_forkserver.py SOCKET_PATH (prints "ready" once it listens).
"""

import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

# Variables read when a request runs, never while the server imported: a request may change these and still fork.
READ_AT_RUN_TIME = (
    "NEURONTRAIN_",
    "NEURON_",
    "AWS_",
    "MASTER_",
    "RAY_ADDRESS",
    "SM_",
    "PYTHONUNBUFFERED",
    "PYTEST_CURRENT_TEST",
)
PATH_ONLY = ("PATH",)  # looked up when a program is started


def can_fork(server_env: dict[str, str], env: dict[str, str]) -> bool:
    """True when `env` differs from the server's environment only in variables read at run time."""
    changed = {k for k in server_env.keys() | env.keys() if server_env.get(k) != env.get(k)}
    return all(k.startswith(READ_AT_RUN_TIME) or k in PATH_ONLY for k in changed)


# -- server ---------------------------------------------------------------------------------------------------------


def _import_heavy_modules() -> None:
    import importlib.util

    import torch  # noqa: F401
    import transformers  # noqa: F401
    import transformers.models.bert.modeling_bert  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import neurontrain.cli  # noqa: F401
    import neurontrain.launch.run  # noqa: F401

    if importlib.util.find_spec("torch_xla") is not None:
        import torch_xla  # noqa: F401


def _preload() -> dict[str, str | None]:
    """Import what a CLI process imports; returns the environment variables the imports set (torch-xla adds to
    XLA_FLAGS and sets defaults at import: a fresh process has them from then on, so every child gets them).
    PJRT_DEVICE is set for the imports only: torch-xla picks a default device on its first device query (with
    its warning) in a child as in a fresh process, never for all children here. Anything the imports print to
    stderr would be missing from the children's stderr, so the server refuses to start then."""
    import tempfile

    before = dict(os.environ)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    saved = os.dup(2)
    with tempfile.TemporaryFile() as printed:
        os.dup2(printed.fileno(), 2)
        try:
            _import_heavy_modules()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        printed.seek(0)
        noise = printed.read().decode(errors="replace").strip()
    if noise:
        raise SystemExit(f"the imports printed to stderr: {noise[:500]}")
    if "PJRT_DEVICE" not in before:
        del os.environ["PJRT_DEVICE"]
    return {k: os.environ.get(k) for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k)}


def _runtime_started() -> bool:
    if "torch_xla" not in sys.modules:
        return False
    import torch_xla

    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def _receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if not message:
        return None
    return json.loads(message), fds


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()


def serve(listener: socket.socket) -> tuple[dict, list[int]] | None:
    """Accept requests until the parent goes away; returns a request in each forked child only."""
    parent = os.getppid()
    children: dict[int, socket.socket] = {}
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        while os.getppid() == parent:
            for _ready in selector.select(timeout=0.05):
                conn, _ = listener.accept()
                received = _receive(conn)
                if received is None:
                    conn.close()
                    continue
                if _runtime_started():
                    raise RuntimeError("the fork server started the XLA runtime: a child would share it")
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    conn.close()
                    for other in children.values():
                        other.close()
                    return received
                for fd in received[1]:
                    os.close(fd)
                children[pid] = conn
                conn.sendall(f"pid {pid}\n".encode())
            _reap(children)
    return None


def _become(request: dict, fds: list[int], set_at_import: dict[str, str | None]) -> None:
    """Turn this forked child into `python -m neurontrain ARGS` as the request describes it."""
    import resource

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    env = dict(request["env"])
    for key, value in set_at_import.items():  # the request may only differ in variables no import reads
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    os.environ.clear()
    os.environ.update(env)
    resource.setrlimit(resource.RLIMIT_NOFILE, tuple(request["nofile"]))
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    sys.argv = [str(Path(__file__).resolve().parents[1] / "neurontrain" / "__main__.py"), *request["args"]]
    sys.path[0] = os.getcwd()


def main() -> None:
    path = sys.argv[1]
    set_at_import = _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    received = serve(listener)
    if received is None:
        return
    _become(*received, set_at_import)
    import runpy

    runpy.run_module("neurontrain", run_name="__main__", alter_sys=True)


# -- client ---------------------------------------------------------------------------------------------------------


class ForkServer:
    """The server of one pytest worker, started on first use with the environment the worker has then."""

    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        self.path = str(directory / "cli.sock")
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the CLI fork server did not start: {line!r}")

    def start(self, args: list[str], cwd: Path, env: dict[str, str]) -> "ForkedCli":
        import resource

        return ForkedCli(
            self.path, {"args": args, "cwd": str(cwd), "env": env, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)}
        )

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


class ForkedCli:
    """One forked `neurontrain` process, with the part of subprocess.Popen's interface the tests use (text
    stdout and stderr pipes, poll, wait, communicate, kill)."""

    def __init__(self, server_path: str, request: dict) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.conn.connect(server_path)
            socket.send_fds(self.conn, [json.dumps(request).encode()], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        self.stdout, self.stderr = open(out_r, encoding="utf-8"), open(err_r, encoding="utf-8")
        self.returncode: int | None = None
        self._replies = b""
        first = self._reply(timeout=None)
        if not first.startswith("pid "):
            raise RuntimeError(f"the CLI fork server refused a request: {first!r}")
        self.pid = int(first.split()[1])

    def _reply(self, timeout: float | None) -> str:
        """The server's next line ('pid N', 'exit CODE'), or '' when none came within `timeout` seconds."""
        while b"\n" not in self._replies:
            self.conn.settimeout(timeout)
            try:
                chunk = self.conn.recv(256)
            except TimeoutError:
                return ""
            if not chunk:
                raise RuntimeError("the CLI fork server closed the connection without an exit code")
            self._replies += chunk
        line, self._replies = self._replies.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._reply(timeout=0.001)
            if line.startswith("exit "):
                self.returncode = int(line.split()[1])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._reply(timeout=timeout)
            if not line:
                raise subprocess.TimeoutExpired(["neurontrain"], timeout)
            self.returncode = int(line.split()[1])
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        texts: dict[str, str] = {}
        readers = [
            threading.Thread(target=lambda n=n, f=f: texts.__setitem__(n, f.read()), daemon=True)
            for n, f in (("out", self.stdout), ("err", self.stderr))
        ]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(["neurontrain"], timeout)
        self.wait(None if deadline is None else max(1.0, deadline - time.monotonic()))
        self.stdout.close()
        self.stderr.close()
        self.conn.close()
        return texts["out"], texts["err"]

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    main()
