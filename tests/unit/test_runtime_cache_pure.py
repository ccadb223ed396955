"""Pure parts of driving the Neuron runtime's cache: where it looks, what we export, module states, flag checks;
and the stand-in compiler refusing what the real one refuses."""

import pytest

from neurontrain.backends import check_xla_flags
from neurontrain.compile.importer import _complete
from neurontrain.compile.runtime_cache import (
    cache_dir_flag,
    extraction_mode,
    gained_neff,
    module_state,
    new_modules,
    runtime_cache_location,
    runtime_environment,
    scan_modules,
    with_cache_dir,
)
from neurontrain.errors import UsageError


def test_cache_location_follows_the_runtime_precedence(tmp_path):
    mine = str(tmp_path / "mine")
    assert runtime_cache_location({}, mine).root == mine
    assert runtime_cache_location({}, mine).source == "runtime.compile_cache"
    env = {"NEURON_COMPILE_CACHE_URL": "/cache/url"}
    assert runtime_cache_location(env, mine).root == "/cache/url"
    env["NEURON_CC_FLAGS"] = "--model-type=transformer --cache_dir=/flag/dir -O1"
    loc = runtime_cache_location(env, mine)
    assert (loc.root, loc.source) == ("/flag/dir", "--cache_dir in NEURON_CC_FLAGS")
    assert not runtime_cache_location({"NEURON_COMPILE_CACHE_URL": "s3://b/p"}, mine).is_local
    assert cache_dir_flag("--cache_dir /a --cache_dir=/b") == "/b"
    assert cache_dir_flag("-O1") is None


def test_exported_environment_appends_flags_and_keeps_the_users():
    loc = runtime_cache_location({}, "/c")
    env = runtime_environment({}, loc, ["--model-type=transformer"])
    assert env == {"NEURON_CC_FLAGS": "--model-type=transformer", "NEURON_COMPILE_CACHE_URL": "/c"}
    user = {"NEURON_CC_FLAGS": "--retry_failed_compilation -O1", "NEURON_COMPILE_CACHE_URL": "/u"}
    env = runtime_environment(user, runtime_cache_location(user, "/c"), ["--model-type=transformer", "-O1"])
    assert env == {"NEURON_CC_FLAGS": "--retry_failed_compilation -O1 --model-type=transformer"}
    # flags already there are not repeated (a worker started by a launcher that exported them)
    again = {"NEURON_CC_FLAGS": env["NEURON_CC_FLAGS"], "NEURON_COMPILE_CACHE_URL": "/u"}
    assert runtime_environment(again, runtime_cache_location(again, "/c"), ["--model-type=transformer"]) == {}


def test_with_cache_dir_replaces_only_the_cache_dir():
    assert (
        with_cache_dir("-O1 --cache_dir /a --model-type=transformer", "/x")
        == "-O1 --model-type=transformer --cache_dir=/x"
    )
    assert with_cache_dir("", "/x y") == "'--cache_dir=/x y'"


def test_extraction_mode_values():
    assert extraction_mode({"NEURON_EXTRACT_GRAPHS_ONLY": "1"})
    assert not extraction_mode({"NEURON_EXTRACT_GRAPHS_ONLY": "0"})
    assert not extraction_mode({"NEURON_EXTRACT_GRAPHS_ONLY": ""})
    assert not extraction_mode({})


def test_module_states_and_scans(tmp_path):
    assert module_state({"model.hlo_module.pb", "compile_flags.json"}) == "extracted"
    assert module_state({"model.hlo_module.pb", "model.hlo_module.pb.lock"}) == "locked"
    assert module_state({"model.hlo_module.pb", "model.log"}) == "failed"
    assert module_state({"model.hlo_module.pb", "model.neff"}) == "extracted"  # a NEFF without done: unfinished
    assert module_state({"model.neff", "model.done", "model.hlo_module.pb"}) == "compiled"
    a = tmp_path / "neuronxcc-2.21" / "MODULE_1+e30acd3a"
    a.mkdir(parents=True)
    (a / "model.hlo_module.pb").write_bytes(b"x")
    before = scan_modules(tmp_path)
    assert before == {"neuronxcc-2.21/MODULE_1+e30acd3a": "extracted"}
    (a / "model.neff").write_bytes(b"N")
    (a / "model.done").touch()
    b = tmp_path / "neuronxcc-2.21" / "MODULE_2+e30acd3a"
    b.mkdir()
    after = scan_modules(tmp_path)
    assert new_modules(before, after) == ["neuronxcc-2.21/MODULE_2+e30acd3a"]
    assert gained_neff(before, after) == ["neuronxcc-2.21/MODULE_1+e30acd3a"]
    assert gained_neff(after, after) == []


def test_import_takes_only_compiled_modules():
    assert _complete({"model.neff": 10, "model.done": 0}) == ""
    assert "empty NEFF" in _complete({"model.neff": 0, "model.done": 0})
    assert "no model.neff" in _complete({"model.log": 10, "model.hlo_module.pb": 5})


def test_xla_flags_are_checked_against_the_library(tmp_path):
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"junk\0xla_cpu_enable_fast_math\0more--xla_dump_to\0end")
    check_xla_flags(["--xla_cpu_enable_fast_math=false", "--xla_dump_to=/tmp/x"], str(lib))
    with pytest.raises(UsageError, match="XLA has no flag --xla_made_up"):
        check_xla_flags(["--xla_made_up=1"], str(lib))
    with pytest.raises(UsageError, match="not an XLA flag"):
        check_xla_flags(["--model-type=transformer"], str(lib))
    with pytest.raises(UsageError, match="XLA has no flag --xla_cpu_enable_fast"):
        check_xla_flags(["--xla_cpu_enable_fast"], str(lib))  # a prefix of a real name is not a flag
