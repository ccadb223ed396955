"""Pure parsing and arithmetic of health checks: nccom-test tables, neuron-ls JSON, sysfs ECC counters,
bus-bandwidth formulas, and the verdict that names bad ranks. No torch."""

from __future__ import annotations

import json
import re
from pathlib import Path

GIB = float(1 << 30)
OPS = ("all_reduce", "all_gather", "reduce_scatter")
NCCOM_OP = {"all_reduce": "allr", "all_gather": "allg", "reduce_scatter": "redsct"}


def bus_factor(op: str, ranks: int) -> float:
    """busbw = algbw x factor (nccl-tests / nccom-test): 2(n-1)/n for all-reduce, (n-1)/n for gather/scatter."""
    if ranks <= 1:
        return 1.0
    return 2.0 * (ranks - 1) / ranks if op == "all_reduce" else (ranks - 1) / ranks


def bandwidths(op: str, ranks: int, size_bytes: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in GiB/s, as nccom-test reports them."""
    algbw = size_bytes / seconds / GIB if seconds > 0 else 0.0
    return algbw, algbw * bus_factor(op, ranks)


_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")
_AVG = re.compile(r"Avg bus bandwidth:\s*([\d.]+)\s*GB/s")
_ERRORS = re.compile(r"(\d+)\s+errors? found - test failed")
# Lines that report a failure: nccom-test's own forms (a size that could not run, the error count, the driver
# check), a runtime or collectives log line at level ERROR/FATAL, a Python traceback or a usage error. Any other
# line (runtime WARN/INFO lines, banners, progress) is kept as a note and fails nothing.
_FAILURE = re.compile(
    r"Failure running|errors? found|test failed|Driver is not running|Traceback \(most recent"
    r"|^\s*(\S+: )?error:|(^|\s)(ERROR|FATAL)(\s|$)"
)
_SIZE_FIRST = re.compile(r"^\s*\d+\s+\S")


def parse_nccom_test(text: str, expected_sizes: list[int] | None = None) -> dict:
    """Rows, average bus bandwidth, failures and notes of an `nccom-test` run. It passes when it has rows, no
    failure line, and (when given) a row for every expected size."""
    rows, failures, notes = [], [], []
    avg = None
    errors = 0
    for line in text.splitlines():
        if not line.strip() or ("size(B)" in line and "busbw" in line):
            continue
        m = _ROW.match(line)
        if m:
            size, count, dtype, time_us, algbw, busbw = m.groups()
            rows.append(
                {
                    "size_bytes": int(size),
                    "count": int(count),
                    "dtype": dtype,
                    "time_us": float(time_us),
                    "algbw_gibps": float(algbw),
                    "busbw_gibps": float(busbw),
                }
            )
        elif m := _AVG.search(line):
            avg = float(m.group(1))
        elif _FAILURE.search(line) or _SIZE_FIRST.match(line):  # also a size row cut short
            if m := _ERRORS.search(line):
                errors = int(m.group(1))
            failures.append(line.strip())
        else:
            notes.append(line.strip())
    missing = sorted(set(expected_sizes or []) - {r["size_bytes"] for r in rows})
    if rows and missing:
        failures.append(f"no result for size(s) {', '.join(map(str, missing))}")
    if not rows and not failures:
        failures.append("no results")
    return {
        "rows": rows,
        "avg_busbw_gibps": avg,
        "errors": errors or len(failures),
        "failures": failures,
        "notes": notes,
        "ok": bool(rows) and not failures,
    }


def parse_neuron_ls(text: str) -> dict:
    """`neuron-ls --json-output`: a list of devices, each with `nc_count` (NeuronCores) among other fields."""
    try:
        devices = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"neuron-ls output is not JSON ({exc.msg})") from None
    if not isinstance(devices, list):
        raise ValueError("neuron-ls JSON output is not a list of devices")
    cores = sum(int(d.get("nc_count", 0)) for d in devices if isinstance(d, dict))
    busy = sorted(
        {
            p.get("pid")
            for d in devices
            if isinstance(d, dict)
            for p in d.get("neuron_processes") or []
            if isinstance(p, dict) and p.get("pid") is not None
        }
    )
    return {"devices": len(devices), "cores": cores, "busy_pids": busy}


ECC_COUNTERS = ("mem_ecc_uncorrected", "mem_ecc_repairable_uncorrected", "sram_ecc_uncorrected")


def read_ecc(root: Path = Path("/sys/devices/virtual/neuron_device")) -> dict[str, dict[str, int]]:
    """Uncorrected ECC counters per device from sysfs (a counter is a file, or a directory with `total`)."""
    out: dict[str, dict[str, int]] = {}
    for device in sorted(root.glob("neuron[0-9]*")):
        counters = {}
        for name in ECC_COUNTERS:
            path = device / "stats" / "hardware" / name
            if path.is_dir():
                path = path / "total"
            if path.is_file():
                try:
                    counters[name] = int(path.read_text().split()[0])
                except (ValueError, IndexError):
                    counters[name] = -1
        out[device.name] = counters
    return out


def verdict(ranks: dict[int, dict | None], expected: range | list[int]) -> list[dict]:
    """Name the bad ranks from per-rank reports.

    A rank is bad when it returned wrong data, died (process gone before finishing), hung (its heartbeat
    stopped), never started, or failed a device check. Ranks whose only problem is an error raised while
    waiting on a peer are victims, named only when no other culprit explains the failure.
    """
    bad, victims = [], []
    for rank in expected:
        r = ranks.get(rank)
        if r is None:
            bad.append({"rank": rank, "host": "?", "check": "start", "problem": "never started"})
            continue
        host, check = r.get("host", "?"), (r.get("current") or {}).get("check") or r.get("last_check", "-")
        wrong = [c for c in r.get("results", []) if c.get("ok") is False and not c.get("error")]
        if wrong:
            bad.append(
                {
                    "rank": rank,
                    "host": host,
                    "check": wrong[0]["check"],
                    "problem": wrong[0].get("problem", "wrong result"),
                }
            )
        elif r.get("state") == "hung":
            how = "hung (process stopped, no heartbeat)" if r.get("stopped") else "hung (no heartbeat)"
            bad.append({"rank": rank, "host": host, "check": check, "problem": how})
        elif r.get("state") == "died":
            bad.append({"rank": rank, "host": host, "check": check, "problem": "died"})
        elif r.get("state") in ("failed", "terminated", "interrupted"):
            victims.append(
                {
                    "rank": rank,
                    "host": host,
                    "check": check,
                    "problem": r.get("error") or f"{r['state']} while waiting on a peer",
                }
            )
    return bad or victims
