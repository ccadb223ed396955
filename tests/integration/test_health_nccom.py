"""Multi-node nccom-test as the NCCOM-TEST guide prescribes it: one invocation from node 0 (MPI mode with
--hosts and NEURON_RT_ROOT_COMM_ID, or Slurm mode), a parser that fails on failure lines and not on runtime
warnings (recorded outputs), and the runner's wiring with the tools replaced by recorders on PATH."""

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import DATA

from neurontrain.errors import UsageError
from neurontrain.health.nccom import NccomMode, expected_sizes, nccom_command, nccom_mode, with_root_comm
from neurontrain.health.parsers import parse_nccom_test


def test_mpi_mode_is_the_documented_multi_node_command():
    """The guide's example: NEURON_RT_ROOT_COMM_ID=10.1.4.145:45654 nccom-test -r 64 -N 2 -d fp32 allr
    --hosts 10.1.4.145 10.1.4.138 (the first host's IP address, any free port)."""
    mode = with_root_comm(nccom_mode(2, 0, ["10.1.4.145", "10.1.4.138"], "10.1.4.145", None), "10.1.4.145", 45654)
    cmd, env = nccom_command("all_reduce", 64, 2, [1024, 1 << 20], 5, mode)
    assert env == {"NEURON_RT_ROOT_COMM_ID": "10.1.4.145:45654"}
    assert cmd[:5] == ["nccom-test", "-r", "64", "-N", "2"]
    assert cmd[cmd.index("-d") + 1] == "fp32" and cmd[cmd.index("-b") + 1] == "1024"
    op = cmd.index("allr")
    assert cmd[op + 1 :] == ["--hosts", "10.1.4.145", "10.1.4.138", "--check"]


def test_slurm_mode_uses_the_jobs_allocation():
    mode = nccom_mode(4, 0, None, "node-a", "12345")
    cmd, env = nccom_command("all_gather", 128, 4, [1024], 3, mode)
    assert env == {} and cmd[cmd.index("-N") + 1] == "4"
    assert cmd[cmd.index("allg") + 1 :] == ["--slurm-mode", "--slurm-job-id", "12345", "--check"]


def test_single_node_and_other_nodes():
    cmd, env = nccom_command("reduce_scatter", 32, 1, [1024, 65536], 10, nccom_mode(1, 0, None, "x", None))
    assert "-N" not in cmd and "--hosts" not in cmd and cmd[-2:] == ["redsct", "--check"] and env == {}
    assert nccom_mode(2, 1, None, "x", None).kind == "skip"  # node 0 runs it for every node
    with pytest.raises(ValueError):
        nccom_command("all_reduce", 64, 2, [1024], 3, NccomMode("skip"))


@pytest.mark.parametrize(
    "hosts, master, job, message",
    [
        (None, "a", None, "pass --hosts NODE0,NODE1,... or run inside a Slurm allocation"),
        (["a"], "a", None, "--hosts lists 1 hosts for --nnodes 2"),
        (["b", "a"], "a", None, "--hosts must start with node 0"),
    ],
)
def test_multi_node_without_a_way_to_reach_the_nodes_is_bad_input(hosts, master, job, message):
    with pytest.raises(UsageError, match=message):
        nccom_mode(2, 0, hosts, master, job)


def test_runtime_warnings_do_not_fail_a_healthy_multi_node_run():
    out = parse_nccom_test((DATA / "nccom_multinode_warnings.txt").read_text(), expected_sizes([8, 1 << 30]))
    assert out["ok"], out["failures"]
    assert len(out["rows"]) == 28 and out["avg_busbw_gibps"] == pytest.approx(9.3924)
    assert len(out["notes"]) == 3 and all("CCOM WARN" in n for n in out["notes"])


def test_a_failed_check_fails():
    out = parse_nccom_test((DATA / "nccom_multinode_check_failed.txt").read_text(), expected_sizes([1024, 1 << 20]))
    assert not out["ok"] and out["errors"] == 1
    assert any("Failure running neuron-bench" in f for f in out["failures"])
    assert any("262144" in f for f in out["failures"])  # the size with no result


@pytest.mark.parametrize(
    "text, why",
    [
        ("nccom-test: error: unrecognized arguments: --slurm-mode\n", "usage error"),
        (
            "2024-May-21 16:08:34.413221 58102:58102 ERROR   NRT:nrt_init  Failed to initialize devices, error:1\n",
            "runtime ERROR line",
        ),
        (
            "    size(B)  count(elems)  type  time(us)  algbw(GB/s)  busbw(GB/s)\n"
            "       1024           256  fp32        58         0.02         0.02\n",
            "a size missing",
        ),
        ("", "no output"),
    ],
)
def test_failure_forms(text, why):
    assert not parse_nccom_test(text, expected_sizes([1024, 4096]))["ok"], why


def _tool(bin_dir: Path, name: str, output: Path, log: Path) -> None:
    """A recorder standing in for a Neuron tool: logs argv and NEURON_RT_ROOT_COMM_ID, prints a recorded output."""
    script = bin_dir / name
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"open({str(log)!r}, 'a').write(json.dumps([sys.argv[1:], "
        "os.environ.get('NEURON_RT_ROOT_COMM_ID')]) + '\\n')\n"
        f"sys.stdout.write(open({str(output)!r}).read())\n"
    )
    script.chmod(0o755)


@pytest.mark.parametrize(
    "fixture, ok", [("nccom_multinode_warnings.txt", True), ("nccom_multinode_check_failed.txt", False)]
)
def test_node_0_runs_nccom_test_across_the_hosts(tmp_path, monkeypatch, fixture, ok):
    from neurontrain.health.runner import HealthOptions, nccom_plan, neuron_checks

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.jsonl"
    _tool(bin_dir, "nccom-test", DATA / fixture, log)
    _tool(bin_dir, "neuron-ls", DATA / "neuron_ls_trn1.json", tmp_path / "ls.jsonl")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    sizes = [8, 1 << 30] if ok else [1024, 1 << 20]
    opts = HealthOptions(
        nproc_per_node=32,
        nnodes=2,
        node_rank=0,
        master_addr="127.0.0.1",
        sizes=sizes,
        iters=5,
        hosts=["127.0.0.1", "localhost"],
        timeout=30,
    )
    result = neuron_checks(opts, 64, nccom_plan(opts))
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 3  # one invocation per collective, for both nodes
    for argv, root in calls:
        assert argv[argv.index("--hosts") + 1 : argv.index("--hosts") + 3] == ["127.0.0.1", "localhost"]
        assert root.startswith("127.0.0.1:") and argv[argv.index("-N") + 1] == "2"
    assert result["ok"] is ok and result["nccom_test"]["mode"] == "mpi"
    if not ok:
        assert result["problems"][0][0] == "nccom-test all_reduce"
    other = HealthOptions(nproc_per_node=32, nnodes=2, node_rank=1, master_addr="127.0.0.1", sizes=sizes)
    assert neuron_checks(other, 64, nccom_plan(other))["nccom_test"] == {
        "mode": "skip",
        "note": "node 0 runs nccom-test across all nodes",
    }
    assert len(log.read_text().splitlines()) == 3  # node 1 ran none


def test_health_multi_node_without_hosts_exits_2_before_any_worker(tmp_path, monkeypatch, capsys):
    from neurontrain.cli import main

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "neuron-ls", DATA / "neuron_ls_trn1.json", tmp_path / "ls.jsonl")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    code = main(
        [
            "health",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "127.0.0.1",
            "--work-dir",
            str(tmp_path / "work"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("neurontrain: error: nccom-test across 2 nodes")
    assert not (tmp_path / "work").exists() or not list((tmp_path / "work").glob("rank*.json"))
