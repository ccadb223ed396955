"""The Neuron compile path, driven with a stand-in neuronx-cc (tests/standin/neuronx-cc) that honours the real
command line. Real NEFF compilation happens only on a Neuron host."""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neurontrain.compile.neuron import LOCK_NAME, NeuronCompiler, clear_stale_locks
from neurontrain.compile.neuron_cache import canonical_flags, entry_state, flags_hash
from neurontrain.errors import UsageError

STANDIN = str(Path(__file__).parent / "standin" / "neuronx-cc")
VERSION = "2.21.18209.0+043b1bf7"


def _graphs(tmp_path, n):
    out = []
    for i in range(n):
        p = tmp_path / "hlo" / f"g{i}.pb"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(f"hlo module {i}".encode() * 50)
        out.append((f"{i:032x}", p))
    return out


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_layout_flags_and_done_markers(tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_CC_SECONDS", "0")
    root = tmp_path / "cache"
    flags = ["--model-type transformer", "-O1"]
    results = NeuronCompiler(root, flags, compiler=STANDIN, workers=2).compile_all(_graphs(tmp_path, 3))
    assert [r.status for r in results] == ["compiled"] * 3
    fh = flags_hash(canonical_flags(flags))
    for gid, hlo in _graphs(tmp_path, 3):
        d = root / f"neuronxcc-{VERSION}" / f"MODULE_{gid}+{fh}"
        assert entry_state(d) == "compiled"
        assert (d / "model.hlo_module.pb").read_bytes() == hlo.read_bytes()
        assert json.loads((d / "compile_flags.json").read_text()) == ["--model-type=transformer", "-O1"]
        assert (d / "model.neff").read_bytes().startswith(b"NEFF")
        assert not (d / LOCK_NAME).exists()
    again = NeuronCompiler(root, ["-O1", "--model-type=transformer"], compiler=STANDIN).compile_all(_graphs(tmp_path, 3))
    assert [r.status for r in again] == ["cached"] * 3  # same flags, other spelling: same entries


def test_workers_really_run_at_once(tmp_path, monkeypatch):
    log = tmp_path / "cc.log"
    monkeypatch.setenv("STANDIN_CC_SECONDS", "1.0")
    monkeypatch.setenv("STANDIN_CC_LOG", str(log))
    start = time.perf_counter()
    results = NeuronCompiler(tmp_path / "cache", [], compiler=STANDIN, workers=4).compile_all(_graphs(tmp_path, 8))
    wall = time.perf_counter() - start
    assert all(r.status == "compiled" for r in results)
    events = sorted((float(t), 1 if e == "start" else -1) for e, _, t, _ in (l.split() for l in log.read_text().splitlines()))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak == 4
    assert wall < 8 * 1.0  # one at a time would take 8 s of compiler sleep alone


def test_transient_crash_is_retried_and_permanent_failure_recorded(tmp_path, monkeypatch):
    graphs = _graphs(tmp_path, 3)
    bad = _sha(graphs[1][1])
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("STANDIN_CC_SECONDS", "0")
    monkeypatch.setenv("STANDIN_CC_CRASH_ONCE", str(markers))
    monkeypatch.setenv("STANDIN_CC_FAIL", bad[:12])
    root = tmp_path / "cache"
    results = {r.graph_id: r for r in NeuronCompiler(root, [], compiler=STANDIN, workers=2, retries=2).compile_all(graphs)}
    ok = results[graphs[0][0]]
    assert ok.status == "compiled" and ok.attempts == 2  # SIGKILLed once, then compiled
    failed = results[graphs[1][0]]
    assert failed.status == "failed" and "exited 1" in failed.error
    d = root / failed.module
    assert entry_state(d) == "failed" and "NCC_INLA001" in (d / "model.log").read_text()
    # cached as failed: not compiled again, still reported
    again = {r.graph_id: r for r in NeuronCompiler(root, [], compiler=STANDIN).compile_all(graphs)}
    assert again[graphs[1][0]].status == "failed" and again[graphs[0][0]].status == "cached"


def test_no_retries_means_a_crash_is_a_failure(tmp_path, monkeypatch):
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("STANDIN_CC_SECONDS", "0")
    monkeypatch.setenv("STANDIN_CC_CRASH_ONCE", str(markers))
    (result,) = NeuronCompiler(tmp_path / "c", [], compiler=STANDIN, retries=0).compile_all(_graphs(tmp_path, 1))
    assert result.status == "failed" and "signal 9" in result.error
    assert not (tmp_path / "c" / result.module / "model.neff").exists()


def test_stale_locks_are_cleaned_and_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_CC_SECONDS", "0")
    root = tmp_path / "cache"
    compiler = NeuronCompiler(root, [], compiler=STANDIN)
    graphs = _graphs(tmp_path, 2)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = compiler.module(graphs[0][0])
    stale.mkdir(parents=True)
    (stale / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "time": time.time()}))
    live = compiler.module(graphs[1][0])
    live.mkdir(parents=True)
    (live / LOCK_NAME).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "time": time.time()}))
    assert clear_stale_locks(root, max_age_seconds=3600) == [stale / LOCK_NAME]
    assert (live / LOCK_NAME).exists()
    old = json.dumps({"pid": os.getpid(), "host": "elsewhere", "time": time.time() - 7200})
    (live / LOCK_NAME).write_text(old)
    assert clear_stale_locks(root, max_age_seconds=3600) == [live / LOCK_NAME]
    results = compiler.compile_all(graphs)
    assert [r.status for r in results] == ["compiled", "compiled"]


def test_missing_compiler_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.delenv("NEURONX_CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UsageError, match="neuronx-cc not found"):
        NeuronCompiler(tmp_path, [])
