"""`checkpoint migrate --layout nxd` (NxD save_checkpoint's tag directory, markers, xser) and the flags' bad input;
--layout optimum-neuron against optimum-neuron's own code: test_optimum_neuron_layout.py."""

import os

import pytest
import torch
from checkpoint_models import hf_tensors, llama
from conftest import cli_in_process

from neurontrain.checkpoint.migrate import MigrateOptions, migrate
from neurontrain.checkpoint.xser import XserFile


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return llama(tmp_path_factory.mktemp("llama"))[1]


def test_nxd_layout_is_a_tag_directory_nxd_lists_and_loads(tmp_path, source):
    dst = tmp_path / "ckpt"
    result = migrate(source, dst, MigrateOptions(to="neuron", tp=4, layout="nxd", tag="step_40", xser=True))
    tag = dst / "step_40"
    assert result["shards"] == str(tag) and result["xser"]
    # NxD: `checkpoint` marks a tag (list_checkpoint_tags), `done` a complete one, each holding "1"
    assert (tag / "checkpoint").read_text() == "1" and (tag / "done").read_text() == "1"
    rank = tag / "model" / "dp_rank_00_tp_rank_03_pp_rank_00.pt"
    assert (tag / "model" / (rank.name + ".tensors")).is_dir() and (tag / "model" / (rank.name + ".info.pt")).is_file()
    assert XserFile(rank)["model.layers.0.self_attn.qkv_proj.weight_k"].shape == (8, 64)  # KV head 1 of 2, tiled

    older = dst / "step_20"  # an older complete tag: NxD's load_checkpoint(dir) takes the newest `done`
    older.mkdir()
    for name in ("checkpoint", "done"):
        (older / name).write_text("1")
    (older / "model").symlink_to(tag / "model")
    os.utime(older / "done", (1, 1))
    back = tmp_path / "back"
    migrate(dst, back, MigrateOptions(to="gpu"))
    original, restored = hf_tensors(source), hf_tensors(back)
    assert original.keys() == restored.keys() and all(torch.equal(original[n], restored[n]) for n in original)


def test_default_layout_is_what_run_loads_with_nxds_done_marker(tmp_path, source):
    dst = tmp_path / "nt"
    result = migrate(source, dst, MigrateOptions(to="neuron", tp=2))
    assert result["layout"] == "neurontrain" and not result["xser"]
    assert (dst / "done").read_text() == "1" and (dst / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt").is_file()
    assert not (dst / "checkpoint").exists()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--to", "neuron", "--tag", "x"], "--tag applies to --layout nxd"),
        (["--to", "neuron", "--xser"], "--xser applies to --layout nxd or optimum-neuron"),
        (["--to", "gpu", "--layout", "nxd"], "--layout, --tag and --xser apply to --to neuron"),
        (["--to", "neuron", "--layout", "nxd", "--tag", "a/b"], "a directory name"),
        (["--to", "neuron", "--layout", "optimum-neuron", "--with-optimizer"], "optim/ files are the trainer's"),
        (["--to", "neuron", "--tp", "4", "--layout", "optimum-neuron", "--pad-vocab-to-multiple-of", "3"], "padding"),
    ],
)
def test_layout_flags_bad_input_is_one_line_and_exit_2(tmp_path, capsys, source, flags, words):
    code, _, err = cli_in_process(capsys, "checkpoint", "migrate", str(source), str(tmp_path / "out"), *flags)
    assert code == 2 and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_tag_whose_save_did_not_finish_is_refused_naming_it(tmp_path, capsys, source):
    dst = tmp_path / "ckpt"
    migrate(source, dst, MigrateOptions(to="neuron", tp=2, layout="nxd"))
    (dst / "migrated" / "done").unlink()
    code, _, err = cli_in_process(capsys, "checkpoint", "inspect", str(dst))
    assert code == 2 and "tag migrated has no `done` marker" in err and err.count("\n") == 1, err
