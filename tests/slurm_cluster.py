"""A real Slurm (Debian's slurm-wlm: munged, slurmctld, slurmd) for the tests, under a temp dir.

Several "nodes" can run on this one machine: one slurmd each (`slurmd -N NAME`), each with its own loopback
address (NodeAddr) and port. The configuration is the cluster's own file (SLURM_CONF in `env`), so nothing under
/etc is touched. Needs root and the slurm-wlm package (`.ci/run` installs it). `stop()` ends what it started.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def available() -> str | None:
    """None when a cluster can be started here, else why not."""
    if os.geteuid() != 0:
        return "starting Slurm daemons needs root"
    missing = [b for b in ("slurmctld", "slurmd", "munged", "mungekey", "sbatch") if shutil.which(b) is None]
    return f"slurm-wlm not installed (missing {', '.join(missing)})" if missing else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, root: Path, nodes: dict[str, str] | None = None) -> None:
        """nodes: name -> address (default: this host alone)."""
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.nodes = nodes or {self.host: self.host}
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = {"SLURM_CONF": str(self.conf), "MUNGE_SOCKET": str(root / "munge" / "munge.socket")}

    def _write_conf(self, state: Path, spool: Path) -> None:
        multi = len(self.nodes) > 1 or self.host not in self.nodes
        cpus = os.cpu_count() or 1
        node_lines = [
            f"NodeName={name} NodeAddr={addr}"
            + (f" NodeHostname={self.host} Port={_free_port()}" if multi else "")
            + f" CPUs={cpus} RealMemory=4000 State=UNKNOWN"
            for name, addr in self.nodes.items()
        ]
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=neurontrain-test",
                    f"SlurmctldHost={self.host}",
                    "SlurmUser=root",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={self.env['MUNGE_SOCKET']}",
                    "CredType=cred/munge",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    f"StateSaveLocation={state}",
                    f"SlurmdSpoolDir={spool}/%n",
                    f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.root / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.root / 'slurmd-%n.log'}",
                    "JobCompType=jobcomp/none",
                    "AccountingStorageType=accounting_storage/none",
                    *node_lines,
                    f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def start(self) -> SlurmCluster:
        state, spool, munge = self.root / "state", self.root / "spool", self.root / "munge"
        for d in (state, spool, munge):
            d.mkdir(parents=True, exist_ok=True)
        key = munge / "munge.key"
        subprocess.run(["mungekey", "-c", "-f", "-k", str(key)], check=True, capture_output=True)
        os.chmod(key, 0o600)
        self.procs.append(
            subprocess.Popen(
                [
                    "munged",
                    "-F",
                    "--force",
                    "-S",
                    self.env["MUNGE_SOCKET"],
                    "--key-file",
                    str(key),
                    "--pid-file",
                    str(munge / "munged.pid"),
                    "--log-file",
                    str(munge / "munged.log"),
                    "--seed-file",
                    str(munge / "munged.seed"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        self._write_conf(state, spool)
        env = {**os.environ, **self.env}
        self.procs.append(
            subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        multi = len(self.nodes) > 1 or self.host not in self.nodes
        for name in self.nodes:
            self.procs.append(
                subprocess.Popen(
                    ["slurmd", "-D", *(["-N", name] if multi else [])],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.time() + 60
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=env)
            states = out.stdout.split()
            if out.returncode == 0 and len(states) == len(self.nodes) and all(s == "idle" for s in states):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"Slurm did not come up: {(self.root / 'slurmctld.log').read_text()[-2000:]}")

    def wait(self, job_id: str, timeout: float) -> str:
        """Block until the job leaves the queue; returns its final state from scontrol."""
        env = {**os.environ, **self.env}
        deadline = time.time() + timeout
        state = "?"
        while time.time() < deadline:
            out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True, text=True, env=env)
            for field in out.stdout.split():
                if field.startswith("JobState="):
                    state = field.split("=", 1)[1]
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return state
            time.sleep(1)
        subprocess.run(["scancel", job_id], capture_output=True, env=env)
        return f"still {state} after {timeout} s"

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
