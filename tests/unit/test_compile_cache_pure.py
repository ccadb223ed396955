"""Pure parts of the compile cache: durations, entry paths, local entries."""

import hashlib
import json

import pytest

from neurontrain.compile.runtime_compile import default_compile_workers
from neurontrain.compile.store import (
    ENTRY_RECORD,
    install_entry,
    local_entries,
    parse_duration,
    sha256_file,
    valid_entry_path,
    verify_local,
)
from neurontrain.errors import UsageError


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
        record = {
            "files": {"model.hlo_module.pb": {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}}
        }
        install_entry(tmp_path, f"graphs/{name}", False, {"model.hlo_module.pb": dl / "f"}, record)
    assert verify_local(tmp_path) == []
    (tmp_path / "graphs" / "g1" / "model.hlo_module.pb").write_bytes(b"hello worle")
    (tmp_path / "graphs" / "g2" / "model.hlo_module.pb").write_bytes(b"other")
    problems = {p["entry"]: p["problem"] for p in verify_local(tmp_path)}
    assert problems["graphs/g1"].startswith("altered")
    assert problems["graphs/g2"].startswith("truncated")


@pytest.mark.parametrize(
    ("memory_gib", "workers"), [(0, 1), (1, 1), (16, 1), (64, 1), (65, 2), (128, 2), (512, 8), (2048, 32)]
)
def test_default_compile_workers_is_one_per_64_gib_of_host_memory_at_least_one(memory_gib, workers):
    assert default_compile_workers(memory_gib << 30) == workers
