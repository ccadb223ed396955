"""Pure parts of the compile cache: Neuron cache names and states, flags, durations, local entries."""

import hashlib
import json

import pytest

from neurontrain.compile.neuron_cache import (canonical_flags, default_workers, entry_state, flags_hash, module_dir,
                                              parse_compiler_version)
from neurontrain.compile.store import (ENTRY_RECORD, install_entry, local_entries, parse_duration, sha256_file,
                                       valid_entry_path, verify_local)
from neurontrain.errors import UsageError


def test_flags_hash_of_no_flags_is_the_md5_of_the_empty_string():
    assert flags_hash(canonical_flags([])) == "d41d8cd9"
    assert flags_hash("--model-type=transformer") == hashlib.md5(b"--model-type=transformer").hexdigest()[:8]


def test_flag_spelling_and_order_do_not_change_the_key():
    a = canonical_flags(["-O1", "--model-type transformer", "--auto-cast=none"])
    b = canonical_flags("--auto-cast none --model-type=transformer -O1")
    assert a == b == "--auto-cast=none --model-type=transformer -O1"
    assert flags_hash(a) == flags_hash(b)
    assert flags_hash(canonical_flags("-O2")) != flags_hash(a)


def test_module_dir_layout(tmp_path):
    d = module_dir(tmp_path, "2.21.18209.0+043b1bf7", "abc123", "")
    assert d == tmp_path / "neuronxcc-2.21.18209.0+043b1bf7" / "MODULE_abc123+d41d8cd9"


def test_entry_states(tmp_path):
    d = tmp_path / "m"
    assert entry_state(d) == "missing"
    d.mkdir()
    (d / "model.hlo_module.pb").write_bytes(b"x")
    assert entry_state(d) == "incomplete"
    (d / "model.hlo_module.pb.lock").write_text("{}")
    assert entry_state(d) == "locked"
    (d / "model.hlo_module.pb.lock").unlink()
    (d / "model.log").write_text("error")
    assert entry_state(d) == "failed"
    (d / "model.neff").write_bytes(b"NEFF")
    assert entry_state(d) == "incomplete"  # a NEFF without the done marker may be half written
    (d / "model.done").touch()
    assert entry_state(d) == "compiled"


def test_compiler_version_and_default_workers():
    assert parse_compiler_version("NeuronX Compiler version 2.21.18209.0+043b1bf7\n") == "2.21.18209.0+043b1bf7"
    with pytest.raises(ValueError):
        parse_compiler_version("command not found")
    gib = 1 << 30
    assert default_workers(cores=2, ram_bytes=24 * gib) == 1        # this machine
    assert default_workers(cores=128, ram_bytes=512 * gib) == 8     # trn1.32xlarge: RAM bound
    assert default_workers(cores=4, ram_bytes=2048 * gib) == 4      # core bound


def test_durations():
    assert parse_duration("30d") == 30 * 86400
    assert parse_duration("12h") == 43200
    assert parse_duration("1.5m") == 90
    for bad in ("", "10", "d", "5y", "-1d"):
        with pytest.raises(UsageError):
            parse_duration(bad)


def test_entry_paths_cannot_escape_the_cache():
    assert valid_entry_path("graphs/abc")
    assert valid_entry_path("manifests/x.json")
    assert valid_entry_path("neuronxcc-2.21/MODULE_abc+d41d8cd9")
    for bad in ("../etc/passwd", "graphs/..", "graphs/.hidden", "graphs/a/b", "other/x", "/graphs/a", "graphs/"):
        assert not valid_entry_path(bad), bad


def _module(root, name, done=True):
    d = root / "neuronxcc-2.21" / name
    d.mkdir(parents=True)
    (d / "model.hlo_module.pb").write_bytes(b"hlo")
    (d / "model.neff").write_bytes(b"NEFF")
    if done:
        (d / "model.done").touch()
    return d


def test_only_complete_entries_are_listed(tmp_path):
    (tmp_path / "graphs" / "g1").mkdir(parents=True)
    (tmp_path / "graphs" / "g1" / "model.hlo_module.pb").write_bytes(b"hlo")
    (tmp_path / "graphs" / "g2").mkdir()  # no HLO: not an entry
    (tmp_path / "manifests").mkdir()
    (tmp_path / "manifests" / "r-1.json").write_text("{}")
    _module(tmp_path, "MODULE_a+d41d8cd9")
    _module(tmp_path, "MODULE_b+d41d8cd9", done=False)
    assert sorted(local_entries(tmp_path)) == ["graphs/g1", "manifests/r-1.json", "neuronxcc-2.21/MODULE_a+d41d8cd9"]


def test_install_is_atomic_and_first_writer_wins(tmp_path):
    src = tmp_path / "dl"
    src.mkdir()
    (src / "a").write_bytes(b"A")
    record = {"files": {"model.hlo_module.pb": {"sha256": sha256_file(src / "a"), "size": 1}}}
    assert install_entry(tmp_path, "graphs/g", False, {"model.hlo_module.pb": src / "a"}, record)
    (src / "b").write_bytes(b"B")
    assert not install_entry(tmp_path, "graphs/g", False, {"model.hlo_module.pb": src / "b"}, record)
    assert (tmp_path / "graphs" / "g" / "model.hlo_module.pb").read_bytes() == b"A"
    assert json.loads((tmp_path / "graphs" / "g" / ENTRY_RECORD).read_text()) == record
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pull-")]


def test_verify_local_names_altered_and_truncated_files(tmp_path):
    for name, payload in (("g1", b"hello world"), ("g2", b"other bytes")):
        dl = tmp_path / f"dl-{name}"
        dl.mkdir()
        (dl / "f").write_bytes(payload)
        record = {"files": {"model.hlo_module.pb": {"sha256": hashlib.sha256(payload).hexdigest(),
                                                    "size": len(payload)}}}
        install_entry(tmp_path, f"graphs/{name}", False, {"model.hlo_module.pb": dl / "f"}, record)
    assert verify_local(tmp_path) == []
    (tmp_path / "graphs" / "g1" / "model.hlo_module.pb").write_bytes(b"hello worle")
    (tmp_path / "graphs" / "g2" / "model.hlo_module.pb").write_bytes(b"other")
    problems = {p["entry"]: p["problem"] for p in verify_local(tmp_path)}
    assert problems["graphs/g1"].startswith("altered")
    assert problems["graphs/g2"].startswith("truncated")
