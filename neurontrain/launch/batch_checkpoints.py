"""A run's checkpoints mirrored to S3, for an AWS Batch job whose next attempt starts on new hosts.

The layout in S3 is the local one (`loop/checkpoints.py`): <prefix>/step_00000020/{state.pt, meta.json, ...,
COMPLETE}. A checkpoint is uploaded file by file with its COMPLETE marker last, so a checkpoint whose marker is
in S3 is whole; checkpoints pruned locally are deleted in S3 after a newer one is complete there. `pull` fetches
the newest complete one into a fresh run directory (through a .partial directory renamed into place), where the
run resumes from it as from its own.
"""

from __future__ import annotations

import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

# The layout of loop/checkpoints.py, which is not imported here: it loads torch, and the node entry starts without
# (a unit test holds the two to the same names).
MARKER = "COMPLETE"
_DIR = re.compile(r"^step_(\d{8})$")
_STEP = re.compile(r"^step_(\d{8})/(.+)$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of the checkpoints under `root` with their marker, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), e) for e in root.iterdir() if (m := _DIR.match(e.name)) and (e / MARKER).is_file()]
    return sorted(found)


def remote_steps(keys: list[str]) -> dict[int, list[str]]:
    """Pure: {step: its files relative to the step directory} of the checkpoints whose marker is listed."""
    files: dict[int, list[str]] = {}
    for key in keys:
        match = _STEP.match(key)
        if match:
            files.setdefault(int(match.group(1)), []).append(match.group(2))
    return {step: sorted(names) for step, names in files.items() if MARKER in names}


class CheckpointMirror:
    """Local checkpoint root <-> s3://bucket/prefix (boto3 client given)."""

    def __init__(self, url: str, local_root: Path, client: Any) -> None:
        self.bucket, _, prefix = url[len("s3://") :].partition("/")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.local_root, self.client = local_root, client
        self.pushed: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _keys(self) -> list[str]:
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            keys += [item["Key"][len(self.prefix) :] for item in page.get("Contents", [])]
        return keys

    def pull(self) -> int | None:
        """Fetch the newest complete checkpoint in S3 into the local root; its step, or None."""
        steps = remote_steps(self._keys())
        if not steps:
            return None
        step = max(steps)
        name = checkpoint_name(step)
        partial = self.local_root / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        for rel in steps[step]:
            target = partial / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            self.client.download_file(self.bucket, f"{self.prefix}{name}/{rel}", str(target))
        partial.rename(self.local_root / name)
        self.pushed = set(steps)
        return step

    def push(self) -> list[int]:
        """Upload the local complete checkpoints S3 lacks (marker last), then delete in S3 the ones pruned here;
        the steps uploaded. A checkpoint pruned while it uploads is skipped (a newer one exists)."""
        uploaded = []
        local = dict(complete_checkpoints(self.local_root))
        for step in sorted(set(local) - self.pushed):
            try:
                files = sorted(p for p in local[step].rglob("*") if p.is_file() and p.name != MARKER)
                for path in [*files, local[step] / MARKER]:
                    key = f"{self.prefix}{checkpoint_name(step)}/{path.relative_to(local[step]).as_posix()}"
                    self.client.upload_file(str(path), self.bucket, key)
            except FileNotFoundError:
                continue
            self.pushed.add(step)
            uploaded.append(step)
        if uploaded:
            self._delete(sorted(s for s in self.pushed if s not in local and s < max(uploaded)))
        return uploaded

    def _delete(self, steps: list[int]) -> None:
        keys = [k for k in self._keys() if any(k.startswith(checkpoint_name(s) + "/") for s in steps)]
        for start in range(0, len(keys), 1000):
            chunk = [{"Key": self.prefix + k} for k in keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk})
        self.pushed -= set(steps)

    def start(self, interval: float = 2.0) -> None:
        """Push in a thread every `interval` seconds until `stop`."""

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.push()
                except Exception as exc:  # a transient S3 error: the next round uploads what is still missing
                    print(f"neurontrain: warning: checkpoint upload to s3://{self.bucket}: {exc}", file=sys.stderr)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and push what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.push()
