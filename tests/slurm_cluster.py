"""A real single-node Slurm (Debian's slurm-wlm: munged, slurmctld, slurmd) for the tests, under a temp dir.

Needs root and the slurm-wlm package (`.ci/run` installs it). Everything it starts is stopped by `stop()`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

SLURM_CONF = Path("/etc/slurm/slurm.conf")


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
    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []
        self._old_conf = SLURM_CONF.read_bytes() if SLURM_CONF.exists() else None

    def start(self) -> "SlurmCluster":
        state, spool, munge = self.root / "state", self.root / "spool", self.root / "munge"
        for d in (state, spool, munge):
            d.mkdir(parents=True, exist_ok=True)
        key = munge / "munge.key"
        subprocess.run(["mungekey", "-c", "-f", "-k", str(key)], check=True, capture_output=True)
        os.chmod(key, 0o600)
        socket_path = munge / "munge.socket"
        self.procs.append(subprocess.Popen(
            ["munged", "-F", "--force", "-S", str(socket_path), "--key-file", str(key),
             "--pid-file", str(munge / "munged.pid"), "--log-file", str(munge / "munged.log"),
             "--seed-file", str(munge / "munged.seed")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        ctld, slurmd = _free_port(), _free_port()
        SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
        SLURM_CONF.write_text("\n".join([
            "ClusterName=neurontrain-test", f"SlurmctldHost={self.node}", "SlurmUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={socket_path}", "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "MpiDefault=none", "ReturnToService=2",
            f"SlurmctldPort={ctld}", f"SlurmdPort={slurmd}",
            f"StateSaveLocation={state}", f"SlurmdSpoolDir={spool}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}", f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}", f"SlurmdLogFile={self.root / 'slurmd.log'}",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            f"NodeName={self.node} CPUs={os.cpu_count()} RealMemory=20000 State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP", ""]))
        env = {**os.environ, "MUNGE_SOCKET": str(socket_path)}
        self.procs.append(subprocess.Popen(["slurmctld", "-D", "-i"], env=env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.procs.append(subprocess.Popen(["slurmd", "-D"], env=env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 60
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated"):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"Slurm did not come up: {(self.root / 'slurmctld.log').read_text()[-2000:]}")

    def wait(self, job_id: str, timeout: float) -> str:
        """Block until the job leaves the queue; returns its final state from scontrol."""
        deadline = time.time() + timeout
        state = "?"
        while time.time() < deadline:
            out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True, text=True)
            for field in out.stdout.split():
                if field.startswith("JobState="):
                    state = field.split("=", 1)[1]
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return state
            time.sleep(1)
        subprocess.run(["scancel", job_id], capture_output=True)
        return f"still {state} after {timeout} s"

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self._old_conf is not None:
            SLURM_CONF.write_bytes(self._old_conf)
        else:
            SLURM_CONF.unlink(missing_ok=True)
