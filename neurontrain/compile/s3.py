"""s3://bucket/prefix compile-cache store through boto3 (endpoint from AWS_ENDPOINT_URL when set).

Layout and publication protocol: see compile/store.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from neurontrain.compile.store import LocalEntry, install_entry, local_entries, run_parallel, valid_entry_path
from neurontrain.errors import NeurontrainError, UsageError

ENTRY_FILE = "ENTRY.json"


def parse_s3_url(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise UsageError(f"bad cache URL {url!r} (expected s3://bucket/prefix or a local directory)")
    bucket, prefix = parsed.netloc, parsed.path.strip("/")
    if not (3 <= len(bucket) <= 63) or not all(c.isalnum() or c in "-." for c in bucket):
        raise UsageError(f"bad bucket name {bucket!r} in {url}")
    return bucket, (prefix + "/" if prefix else "")


@dataclass
class TransferReport:
    entries: int = 0
    objects: int = 0
    bytes: int = 0
    skipped: int = 0
    refused: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "entries": self.entries,
            "objects": self.objects,
            "bytes": self.bytes,
            "skipped": self.skipped,
            "refused": self.refused,
        }


class S3Store:
    def __init__(self, url: str, workers: int = 8) -> None:
        self.url = url
        self.bucket, self.prefix = parse_s3_url(url)
        self.workers = workers
        self._client = None

    # -- connection and errors ------------------------------------------------------------------------
    @property
    def client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client(
                "s3",
                endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
                config=Config(
                    retries={"max_attempts": 3, "mode": "standard"}, max_pool_connections=max(10, self.workers * 2)
                ),
            )
        return self._client

    def check(self) -> None:
        """One-line errors for a missing bucket, missing credentials or an unreachable endpoint."""
        from botocore.exceptions import (
            ClientError,
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (NoCredentialsError, PartialCredentialsError):
            raise UsageError(
                f"no AWS credentials for {self.url} (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)"
            ) from None
        except EndpointConnectionError as exc:
            raise UsageError(f"cannot reach the S3 endpoint for {self.url}: {exc}") from None
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise UsageError(f"bucket {self.bucket!r} does not exist ({self.url})") from None
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise UsageError(f"access to {self.url} denied ({code}): check the credentials") from None
            raise NeurontrainError(f"S3 error on {self.url}: {code}") from None

    def _key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def _blob_key(self, sha: str) -> str:
        return self._key("blobs", sha)

    # -- listing ---------------------------------------------------------------------------------------
    def list_entries(self) -> dict[str, float]:
        """Published entries: path -> publication time (epoch seconds)."""
        out = {}
        start = self._key("entries") + "/"
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            for obj in page.get("Contents", []):
                key = obj["Key"][len(start) :]
                if key.endswith("/" + ENTRY_FILE):
                    path = key[: -len(ENTRY_FILE) - 1]
                    if valid_entry_path(path):
                        out[path] = obj["LastModified"].timestamp()
        return out

    def list_blobs(self) -> dict[str, float]:
        out = {}
        start = self._key("blobs") + "/"
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(start) :]] = obj["LastModified"].timestamp()
        return out

    def get_record(self, path: str) -> dict:
        body = self.client.get_object(Bucket=self.bucket, Key=self._key("entries", path, ENTRY_FILE))["Body"].read()
        return json.loads(body)

    # -- push ------------------------------------------------------------------------------------------
    def _blob_exists(self, sha: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._blob_key(sha))
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def _publish(self, record: dict) -> bool:
        """Conditional put of ENTRY.json: True if this call published it, False if it already existed."""
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(
                Bucket=self.bucket,
                Key=self._key("entries", record["path"], ENTRY_FILE),
                Body=json.dumps(record).encode(),
                IfNoneMatch="*",
                ContentType="application/json",
            )
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in (
                "PreconditionFailed",
                "ConditionalRequestConflict",
                "412",
                "409",
            ):
                return False
            raise

    def push(self, root: Path, only: set[str] | None = None) -> TransferReport:
        """Publish local entries missing remotely: missing blobs first, then each entry's record."""
        self.check()
        report = TransferReport()
        remote = self.list_entries()
        local = local_entries(root)
        todo = [e for p, e in local.items() if p not in remote and (only is None or p in only)]
        report.skipped = len(local) - len(todo)
        records = run_parallel(LocalEntry.record, todo, self.workers, "hash", "entry")
        blobs: dict[str, Path] = {}
        for entry, record in zip(todo, records):
            for name, meta in record["files"].items():
                blobs.setdefault(meta["sha256"], entry.files()[name])

        def upload(item: tuple[str, Path]) -> int:
            sha, path = item
            if self._blob_exists(sha):
                return 0
            self.client.upload_file(str(path), self.bucket, self._blob_key(sha))
            return path.stat().st_size

        sent = run_parallel(upload, sorted(blobs.items()), self.workers, "push", "obj")
        report.objects = sum(1 for n in sent if n)
        report.bytes = sum(sent)
        published = run_parallel(self._publish, records, self.workers, "publish", "entry")
        report.entries = sum(published)
        return report

    # -- pull ------------------------------------------------------------------------------------------
    def _download_verified(self, sha: str, size: int, dest_dir: Path) -> Path:
        """Download a blob to a temporary file, checking size and SHA-256. Raises ValueError on mismatch."""
        from botocore.exceptions import ClientError

        fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".blob-")
        digest, got = hashlib.sha256(), 0
        try:
            with os.fdopen(fd, "wb") as fh:
                try:
                    body = self.client.get_object(Bucket=self.bucket, Key=self._blob_key(sha))["Body"]
                except ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                        raise ValueError("missing object") from None
                    raise
                for chunk in iter(lambda: body.read(1 << 20), b""):
                    fh.write(chunk)
                    digest.update(chunk)
                    got += len(chunk)
            if got != size:
                raise ValueError(f"truncated or extended object ({got} of {size} bytes)")
            if digest.hexdigest() != sha:
                raise ValueError("altered object (sha256 mismatch)")
            return Path(tmp)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def verify_entry(self, path: str) -> list[dict]:
        problems = []
        try:
            record = self.get_record(path)
        except (ValueError, KeyError) as exc:
            return [{"entry": path, "file": ENTRY_FILE, "problem": f"unreadable record ({exc})"}]
        with tempfile.TemporaryDirectory() as tmp:
            for name, meta in record["files"].items():
                try:
                    self._download_verified(meta["sha256"], meta["size"], Path(tmp)).unlink()
                except ValueError as exc:
                    problems.append(
                        {"entry": path, "file": name, "object": self._blob_key(meta["sha256"]), "problem": str(exc)}
                    )
        return problems

    def verify(self) -> list[dict]:
        self.check()
        results = run_parallel(self.verify_entry, sorted(self.list_entries()), self.workers, "verify", "entry")
        return [p for problems in results for p in problems]

    def pull(self, root: Path, only: set[str] | None = None) -> TransferReport:
        """Fetch remote entries missing locally; every file is verified before the entry is installed."""
        self.check()
        report = TransferReport()
        root.mkdir(parents=True, exist_ok=True)
        have = local_entries(root)
        remote = self.list_entries()
        todo = [p for p in sorted(remote) if p not in have and (only is None or p in only) and not (root / p).exists()]
        report.skipped = len(remote) - len(todo)

        def fetch(path: str) -> tuple[int, int, int, dict | None]:
            record = self.get_record(path)
            files: dict[str, Path] = {}
            try:
                for name, meta in record["files"].items():
                    try:
                        files[name] = self._download_verified(meta["sha256"], meta["size"], root)
                    except ValueError as exc:
                        return (
                            0,
                            0,
                            0,
                            {
                                "entry": path,
                                "file": name,
                                "object": self._blob_key(meta["sha256"]),
                                "problem": str(exc),
                            },
                        )
                size = sum(p.stat().st_size for p in files.values())
                count = len(files)
                installed = install_entry(root, path, record.get("is_file", False), files, record)
                return (1, size, count, None) if installed else (0, 0, 0, None)
            finally:
                for p in files.values():
                    p.unlink(missing_ok=True)

        for done, size, count, problem in run_parallel(fetch, todo, self.workers, "pull", "entry"):
            report.entries += done
            report.objects += count
            report.bytes += size
            if problem:
                report.refused.append(problem)
        return report

    # -- prune -----------------------------------------------------------------------------------------
    def prune(self, older_than_seconds: float, now: float) -> dict:
        """Delete entries published before the cutoff, then blobs no remaining entry uses (and themselves older
        than the cutoff, so a concurrent push's fresh uploads are never collected)."""
        self.check()
        cutoff = now - older_than_seconds
        entries = self.list_entries()
        old = [p for p, t in entries.items() if t < cutoff]
        for path in old:
            self.client.delete_object(Bucket=self.bucket, Key=self._key("entries", path, ENTRY_FILE))
        keep = [p for p in entries if p not in old]
        used = set()
        for record in run_parallel(self.get_record, keep, self.workers, "scan", "entry"):
            used |= {m["sha256"] for m in record["files"].values()}
        garbage = [sha for sha, t in self.list_blobs().items() if sha not in used and t < cutoff]
        for sha in garbage:
            self.client.delete_object(Bucket=self.bucket, Key=self._blob_key(sha))
        return {"entries_removed": len(old), "objects_removed": len(garbage), "entries_kept": len(keep)}
