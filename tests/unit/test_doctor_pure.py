"""`neurontrain doctor`'s pure parts: the flags the runtime will hash, each check's verdict, the report schema."""

import json

import pytest
from conftest import cli_in_process

from neurontrain.compile import neuron_runtime
from neurontrain.compile.runtime_cache import (
    compiler_tokens,
    expected_flags_hash,
    platform_target,
    runtime_compiler_flags,
)
from neurontrain.doctor import verdicts
from neurontrain.doctor.context import scratch_environment
from neurontrain.doctor.report import (
    REPORTED_VARIABLES,
    SCHEMA_VERSION,
    CheckResult,
    build_report,
    exit_code,
    format_table,
    result_of,
)
from neurontrain.doctor.runner import selected

V = "neuronxcc-2.21.0"
PRE = [f"{V}/MODULE_11+e30acd3a", f"{V}/MODULE_22+e30acd3a"]


def test_runtime_flags_drop_the_wrapper_options_and_keep_the_order():
    env = {"NEURON_CC_FLAGS": "--retry_failed_compilation -O1 --cache_dir /c --log_level INFO --model-type=transformer"}
    assert compiler_tokens(env["NEURON_CC_FLAGS"]) == ["-O1", "--model-type=transformer"]
    flags = runtime_compiler_flags(env, ["--auto-cast=none", "-O1"], "trn1")
    assert flags == ["--target=trn1", "-O1", "--model-type=transformer", "--auto-cast=none"]
    assert runtime_compiler_flags({}, [], None) == []
    # the hashes public caches show for these lists
    assert expected_flags_hash(["--target=trn1"]) == "e30acd3a" and expected_flags_hash([]) == "d41d8cd9"


def test_target_from_the_override_then_the_instance_type():
    assert platform_target({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn2"}, "trn1.32xlarge") == "trn2"
    assert platform_target({}, "trn1.32xlarge") == "trn1"
    assert platform_target({}, "m5.large") is None and platform_target({}, None) is None


def test_env_json_shows_the_flags_the_runtime_gets(monkeypatch, capsys):
    """`env --json` with a runtime and NEURON_CC_FLAGS set reported `compiler_flags: []`."""
    from neurontrain.backends.eager import EagerBackend
    from neurontrain.commands import env as env_command

    monkeypatch.setenv("NEURON_CC_FLAGS", "--retry_failed_compilation -O1")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    monkeypatch.setattr(env_command, "select_backend", lambda name: EagerBackend("eager", "gloo", False))
    monkeypatch.setattr(env_command, "neuron_runtime_present", lambda: True)
    monkeypatch.setattr(neuron_runtime, "compiler_version_dir", lambda: f"{V}")
    code, out, _ = cli_in_process(capsys, "env", "--json")
    info = json.loads(out)
    assert code == 0 and info["compiler_flags"] == ["--target=trn1", "-O1"]
    assert info["compiler_flags_hash"] == expected_flags_hash(["--target=trn1", "-O1"])
    assert info["compiler_version_dir"] == V and info["target_decided_by"] == "NEURON_PLATFORM_TARGET_OVERRIDE"


def _compile(after_extra=(), summary=None, flags_of=None, predicted=None, states=None):
    before = {m: "compiled" for m in PRE}
    after = {**before, **dict.fromkeys(after_extra, "compiled"), **(states or {})}
    summary = summary or {"neuron_cache": {"compiled_at_run_time": len(after_extra), "cache_hits": 2}}
    return verdicts.compile_once_verdict(1, PRE, before, after, summary, flags_of or {}, predicted)


def test_compile_verdicts_name_the_fault():
    assert _compile().problem is None
    assert _compile(predicted=["--target=trn1"]).problem is None
    renamed = _compile([f"{V}/MODULE_33+e30acd3a"]).problem
    assert "module names differ between extraction and execution" in renamed
    flags = {PRE[0]: ["--target=trn1"], f"{V}/MODULE_44+0badf1a6": ["--target=trn1", "-O1"]}
    moved = _compile([f"{V}/MODULE_44+0badf1a6"], flags_of=flags).problem
    assert "flags hash 0badf1a6, precompile's e30acd3a (the run adds -O1)" in moved
    assert verdicts.flags_difference(["-O1"], ["-O1", "-O1"]) == "adds -O1"
    assert verdicts.flags_difference(["-O1", "-O2"], ["-O2", "-O1"]) == "same flags in another order"
    predicted = _compile(predicted=["--target=trn1", "-O1"], flags_of={PRE[0]: ["--target=trn1"]}).problem
    assert "the toolkit predicts" in predicted and "drops -O1" in predicted
    assert "no NEFF" in _compile(states={PRE[1]: "extracted"}).problem
    assert "compiled 1 modules at run time" in _compile(summary={"neuron_cache": {"compiled_at_run_time": 1}}).problem
    empty = verdicts.compile_once_verdict(1, [], {}, {}, {}, {})
    assert "recorded no runtime modules" in empty.problem


def test_the_other_verdicts():
    a = {1: 2.0, 2: 1.5}
    assert verdicts.losses_verdict("dp", a, {1: 2.0, 2: 1.5 * (1 + 5e-6)}).problem is None
    off = verdicts.losses_verdict("dp", a, {1: 2.0, 2: 1.6}).problem
    assert off.startswith("dp: loss differs by") and "at step 2" in off
    assert "different steps" in verdicts.losses_verdict("dp", a, {1: 2.0}).problem
    assert verdicts.losses_verdict("dp", {1: float("nan")}, {1: 1.0}).problem  # NaN never passes
    assert "resumed from 4" in verdicts.resume_verdict(4, 2, True, True).problem
    assert "does not restore" in verdicts.resume_verdict(2, 2, False, True).problem
    assert verdicts.resume_verdict(2, 2, True, True).problem is None
    assert "do not merge back" in verdicts.merge_verdict({"equal": False, "logits_max_abs_diff": 0.3}).problem
    assert "published summary.json" in verdicts.extraction_verdict(["summary.json"], []).problem
    assert "compiled 1 modules" in verdicts.extraction_verdict([], ["m"]).problem
    bad = {"ok": False, "world_size": 2, "bad_ranks": [{"rank": 1, "problem": "wrong sum", "check": "all_reduce"}]}
    assert verdicts.health_verdict(bad).problem == "collectives: rank 1: wrong sum (all_reduce)"
    assert "recompiles" in verdicts.native_verdict(verdicts.losses_verdict("n", a, a), 5, 2).problem


def test_native_compile_once_verdict_wants_every_worker_loaded_and_compiling_nothing():
    report = {"workers": 2, "ranks_compiled": {"0": [0, 1]}}

    def worker(rank, loaded=True, neffs=0, refused=None):
        return {"rank": rank, "loaded": loaded, "refused": refused, "neff_cache": {"compiled": neffs}}

    def summary(*workers):
        return {"compile_cache": {"native": {"workers": list(workers)}}}

    ok = verdicts.native_compile_once_verdict(report, summary(worker(0), worker(1)))
    assert ok.problem is None and ok.figures["precompile_ranks"] == [0]
    late = verdicts.native_compile_once_verdict(report, summary(worker(0), worker(1, neffs=2)))
    assert late.problem == "workers compiled at run time although precompile's entry loaded: {1: 2}"
    refused = verdicts.native_compile_once_verdict(report, summary(worker(0), worker(1, False, 0, "altered")))
    assert refused.problem == "workers [1] did not load precompile's entry {1: 'altered'}"
    assert "1 workers reported" in verdicts.native_compile_once_verdict(report, summary(worker(0))).problem
    inductor = {"rank": 0, "loaded": True, "graphs_compiled": 1}  # no NEFF directory: AOTAutograd's misses count
    assert "{0: 1}" in verdicts.native_compile_once_verdict({"workers": 1}, summary(inductor)).problem


def test_environment_verdict():
    facts = {"product": "trn1.32xlarge", "devices": ["/dev/neuron0"] * 16, "backend": "neuron", "runtime": True}
    facts |= {"compiler": {"compiler_version_dir": V}, "cache_root": "/c", "cache_writable": True}
    assert verdicts.environment_verdict(facts).problem is None
    assert (
        "shows 15 Neuron devices, expected 16" in verdicts.environment_verdict({**facts, "devices": ["d"] * 15}).problem
    )
    assert "picks xla-cpu" in verdicts.environment_verdict({**facts, "backend": "xla-cpu"}).problem
    assert "neuronx-cc is not on PATH" in verdicts.environment_verdict({**facts, "compiler": {}}).problem
    assert "not writable" in verdicts.environment_verdict({**facts, "cache_writable": False}).problem
    here = {**facts, "product": None, "backend": "xla-cpu", "devices": []}
    assert verdicts.environment_verdict(here).problem is None


def test_report_schema_carries_only_the_listed_variables():
    results = [
        result_of("environment", verdicts.losses_verdict("x", {1: 1.0}, {1: 1.0}), 0.5),
        result_of("data-parallel", verdicts.losses_verdict("x", {1: 1.0}, {1: 2.0}), 3.0),
        CheckResult("zero1", "skipped", message="ZeRO-1 needs --nproc-per-node 2 or more"),
    ]
    environ = {"NEURON_CC_FLAGS": "-O1", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "HOME": "/root", "XLA_FLAGS": "--x"}
    report = build_report("quick", results, environ, 0.0, "0.1.0")
    assert report["schema"] == "neurontrain-doctor" and report["schema_version"] == SCHEMA_VERSION
    assert report["environment"] == {"NEURON_CC_FLAGS": "-O1", "XLA_FLAGS": "--x"}
    assert set(report["environment"]) <= set(REPORTED_VARIABLES) and "s3cr3t" not in json.dumps(report)
    assert [c["status"] for c in report["checks"]] == ["pass", "fail", "skipped"] and report["ok"] is False
    assert report["checks"][1]["docs"] == "docs/doctor.md#data-parallel"
    assert exit_code(results) == 3 and exit_code(results[:1] + results[2:]) == 0
    table = format_table(results)
    assert "-> x: loss differs" in table and "needs --nproc-per-node 2" in table


def test_scratch_environment_leaves_the_cache_to_the_doctor():
    env = scratch_environment(
        {"NEURON_CC_FLAGS": "--cache_dir /u -O1 --cache_dir=/v", "NEURON_COMPILE_CACHE_URL": "s3://b/p", "A": "1"}
    )
    assert env["NEURON_CC_FLAGS"] == "-O1" and "NEURON_COMPILE_CACHE_URL" not in env and env["A"] == "1"


@pytest.mark.parametrize("mode", ["quick", "full"])
def test_quick_is_a_subset_of_full(mode):
    names = [c.name for c in selected(mode)]
    quick = ["environment", "compile-once", "collectives", "data-parallel", "checkpoint"]
    full = [*quick, "zero1", "tensor-parallel", "native", "native-compile-once"]
    assert names == (quick if mode == "quick" else full)
    assert [c.name for c in selected("quick", ["zero1"])] == ["zero1"]
