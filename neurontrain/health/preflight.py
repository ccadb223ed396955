"""Preflight before the first training step: the device checks of `neurontrain health` on this worker and,
with several workers, an all-reduce and an all-gather with known results across them. Runs in every worker
at every (re)start, so a group that torchrun restarts is checked again. Exit 3 names the bad rank."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import torch

from neurontrain.errors import HealthCheckFailed
from neurontrain.health.worker import device_checks, expected_pattern
from neurontrain.logs import get_logger

log = get_logger(__name__)


def _collectives(dp) -> list[dict]:
    results = []
    numel = 1024 * dp.world
    t0 = time.perf_counter()
    buf = expected_pattern(numel, dp.rank, torch.float32)
    dp.all_reduce_host(buf)
    want = expected_pattern(numel, 0, torch.float32) * (dp.world * (dp.world + 1) // 2)
    results.append(
        {
            "check": "all_reduce",
            "ok": bool(torch.equal(buf, want)),
            "seconds": round(time.perf_counter() - t0, 4),
            "problem": "all-reduce returned wrong values",
        }
    )
    t0 = time.perf_counter()
    gathered = dp.all_gather_object(dp.rank)
    results.append(
        {
            "check": "all_gather",
            "ok": gathered == list(range(dp.world)),
            "seconds": round(time.perf_counter() - t0, 4),
            "problem": f"all-gather returned {gathered}",
        }
    )
    for r in results:
        if r["ok"]:
            r.pop("problem")
    return results


def preflight(backend, recipe, dp, output_dir: Path | None = None) -> None:
    """Raise HealthCheckFailed (exit 3) naming the first failed check and its rank."""
    t0 = time.perf_counter()
    results = device_checks(backend, recipe.runtime.expected_devices)
    if dp.enabled:
        results += _collectives(dp)
    mine = {"rank": dp.rank, "host": socket.gethostname(), "ok": all(r["ok"] for r in results), "checks": results}
    ranks = dp.all_gather_object(mine) if dp.enabled else [mine]
    record = {
        "time": round(time.time(), 3),
        "restart": dp.restart,
        "world_size": dp.world,
        "seconds": round(time.perf_counter() - t0, 3),
        "ok": all(r["ok"] for r in ranks),
        "ranks": ranks,
    }
    if output_dir is not None and dp.is_master:
        output_dir.mkdir(parents=True, exist_ok=True)
        with open(output_dir / "preflight.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
    bad = [(r, c) for r in ranks for c in r["checks"] if not c["ok"]]
    if bad:
        rank, check = bad[0]
        raise HealthCheckFailed(
            f"preflight failed on {backend.name}, rank {rank['rank']} on {rank['host']}: "
            f"{check['check']}: {check['problem']} (skip with --no-preflight or "
            "runtime.preflight: false)"
        )
    if dp.is_master:
        what = f"{len(results)} checks" + (f" on each of {dp.world} workers" if dp.enabled else "")
        restart = f", restart {dp.restart}" if dp.restart else ""
        log.info(f"preflight ok ({what}, {record['seconds']:.1f} s{restart})")
