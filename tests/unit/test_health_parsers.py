"""Pure health logic: nccom-test and neuron-ls parsers on recorded outputs, ECC counters, busbw, verdicts."""

import pytest
from conftest import DATA

from neurontrain.health.parsers import bandwidths, bus_factor, parse_nccom_test, parse_neuron_ls, read_ecc, verdict


def test_nccom_sweep_table():
    out = parse_nccom_test((DATA / "nccom_allr_ok.txt").read_text())
    assert out["ok"] and out["failures"] == [] and len(out["rows"]) == 11
    assert out["rows"][0] == {
        "size_bytes": 1024,
        "count": 256,
        "dtype": "fp32",
        "time_us": 58.0,
        "algbw_gibps": 0.02,
        "busbw_gibps": 0.02,
    }
    assert out["rows"][-1]["busbw_gibps"] == 52.83 and out["avg_busbw_gibps"] == pytest.approx(23.6671)


def test_nccom_check_table():
    out = parse_nccom_test((DATA / "nccom_allg_check_ok.txt").read_text())
    assert out["ok"] and [r["size_bytes"] for r in out["rows"]] == [1024, 8192, 65536, 524288]


def test_nccom_failure_forms():
    immediate = parse_nccom_test((DATA / "nccom_driver_not_running.txt").read_text())
    assert not immediate["ok"] and "Driver is not running" in immediate["failures"][0]
    bench = parse_nccom_test((DATA / "nccom_bench_failure.txt").read_text())
    assert not bench["ok"] and bench["errors"] == 1
    assert any("Failure running neuron-bench" in f for f in bench["failures"])
    assert not parse_nccom_test("")["ok"]


def test_neuron_ls_json():
    out = parse_neuron_ls((DATA / "neuron_ls_trn1.json").read_text())
    assert out == {"devices": 16, "cores": 32, "busy_pids": [4242]}
    with pytest.raises(ValueError):
        parse_neuron_ls("neuron-ls: command not found")
    with pytest.raises(ValueError):
        parse_neuron_ls('{"not": "a list"}')


def test_ecc_counters_from_sysfs(tmp_path):
    hw0 = tmp_path / "neuron0" / "stats" / "hardware"
    hw0.mkdir(parents=True)
    (hw0 / "mem_ecc_uncorrected").write_text("0\n")
    (hw0 / "sram_ecc_uncorrected").mkdir()
    (hw0 / "sram_ecc_uncorrected" / "total").write_text("3\n")  # counter form: a directory with total/present
    (tmp_path / "neuron1" / "stats" / "hardware").mkdir(parents=True)
    assert read_ecc(tmp_path) == {"neuron0": {"mem_ecc_uncorrected": 0, "sram_ecc_uncorrected": 3}, "neuron1": {}}


def test_bus_bandwidth_formulas():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 32) == pytest.approx(62 / 32)
    assert bus_factor("all_gather", 2) == 0.5 and bus_factor("reduce_scatter", 4) == 0.75
    algbw, busbw = bandwidths("all_reduce", 4, 1 << 30, 0.5)
    assert algbw == pytest.approx(2.0) and busbw == pytest.approx(3.0)


def test_verdict_names_culprits_not_victims():
    done = {"state": "done", "host": "h", "results": [{"check": "all_reduce 1024B", "ok": True}]}
    victim = {
        "state": "failed",
        "host": "h",
        "error": "RuntimeError: Connection closed by peer",
        "results": [{"check": "all_reduce 1024B", "ok": False, "error": "RuntimeError: ..."}],
    }
    wrong = {
        "state": "done",
        "host": "h2",
        "results": [{"check": "all_gather 2048B", "ok": False, "problem": "wrong result"}],
    }
    assert verdict({0: victim, 1: {**victim, "state": "died", "current": {"check": "all_gather 2048B"}}}, [0, 1]) == [
        {"rank": 1, "host": "h", "check": "all_gather 2048B", "problem": "died"}
    ]
    assert verdict({0: done, 1: wrong}, [0, 1])[0]["rank"] == 1
    assert verdict({0: done, 1: None}, [0, 1]) == [
        {"rank": 1, "host": "?", "check": "start", "problem": "never started"}
    ]
    assert verdict({0: victim, 1: done}, [0, 1])[0]["rank"] == 0  # no culprit: the victim is named
    assert verdict({0: done, 1: done}, [0, 1]) == []
    stopped = {"state": "hung", "stopped": True, "host": "h", "current": {"check": "start-up"}}
    waited = {"state": "interrupted", "host": "h", "current": {"check": "rendezvous"}}
    assert verdict({0: waited, 1: stopped}, [0, 1]) == [
        {"rank": 1, "host": "h", "check": "start-up", "problem": "hung (process stopped, no heartbeat)"}
    ]
