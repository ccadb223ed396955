"""TorchNeuron's NEFF cache goes with the native entry: under runtime.compile_cache unless the user names one,
archived byte for byte into the entry under its sha256 record, restored before the first compile."""

from neurontrain.compile.native_cache import entry_problem, write_entry
from neurontrain.compile.neff_cache import (
    NEFF_ARCHIVE,
    NEFF_ENV,
    archive_neffs,
    neff_files,
    point_neff_cache,
    restore_neffs,
)


def test_the_neff_cache_is_under_the_compile_cache_unless_the_user_names_one(tmp_path):
    env: dict[str, str] = {}
    assert point_neff_cache(env, tmp_path / "cache") == tmp_path / "cache" / "torchneuron-neff"
    assert env[NEFF_ENV] == str(tmp_path / "cache" / "torchneuron-neff")
    mine = {NEFF_ENV: str(tmp_path / "mine")}
    assert point_neff_cache(mine, tmp_path / "cache") == tmp_path / "mine" and mine[NEFF_ENV] == str(tmp_path / "mine")


def test_neffs_round_trip_through_a_verified_entry(tmp_path):
    compiled = tmp_path / "compiled"
    (compiled / "MODULE_1").mkdir(parents=True)
    (compiled / "MODULE_1" / "model.neff").write_bytes(b"\x7fNEFF" * 500)
    (compiled / "index.json").write_text('{"graphs": 1}')
    path = "native/tiny-0123456789abcdef"
    entry = write_entry(tmp_path / "cache", path, b"artifacts", {"graphs": []}, archive_neffs(compiled))
    assert entry_problem(entry) is None
    fresh = tmp_path / "fresh"
    assert restore_neffs(entry / NEFF_ARCHIVE, fresh) == 2
    assert neff_files(fresh) == ["MODULE_1/model.neff", "index.json"]
    assert (fresh / "MODULE_1" / "model.neff").read_bytes() == b"\x7fNEFF" * 500
    assert restore_neffs(entry / NEFF_ARCHIVE, fresh) == 0  # what is there stays
    (entry / NEFF_ARCHIVE).write_bytes(archive_neffs(fresh)[:-10])
    assert entry_problem(entry).startswith(f"{NEFF_ARCHIVE} truncated or extended")
