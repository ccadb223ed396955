"""Checkpoints as a newer torch than the installed 2.9 writes them, built here in the forms such releases use:
what still reads, and the one line (exit 2) for what cannot, naming what the files record and what to do.

The forms, and where they come from:
- DCP `.metadata` is `pickle.dump(Metadata)` (torch/distributed/checkpoint/filesystem.py, _FileSystemWriter.finish),
  so it names every class it holds by module path. When a release adds a class there, older releases cannot
  unpickle it: StorageMeta, which torch 2.3/2.4 added to torch.distributed.checkpoint.metadata and put into every
  `.metadata` (Metadata.storage_meta), failed on older torch with "Can't get attribute 'StorageMeta'"
  (mosaicml/composer#3252, NVIDIA/nvidia-resiliency-ext#87). No class added to DCP's metadata after 2.9 was found
  in the torch sources searched (main's metadata.py and filesystem.py as indexed; CURRENT_DCP_VERSION is still
  "1.0.0" there), so the test gives the metadata a class of that module that 2.9 lacks, pickled as that release
  would pickle it.
- Metadata.version, the DCP format version (pytorch/pytorch#155343; 2.9 writes "1.0.0"): a newer major version
  is refused, a newer minor one read.
- Fields a release adds to a metadata dataclass (Metadata.version itself, for releases before it; Megatron-LM's
  `mcore_data` attribute, pytorch/pytorch#162948) read: pickled dataclasses restore every field they carry.
- torch.save archives record their format version (`<archive>/version`); torch refuses one above the version it
  reads (caffe2/serialize/inline_container.cc, kMaxSupportedFileFormatVersion).
- A torch.save pickle naming a torch function this torch lacks: how torch 0.4's `_rebuild_tensor_v2` broke 0.3
  readers (pytorch/pytorch#5729); here `_rebuild_tensor_v4` (2.9 has v2 and v3).
- Records this torch does not know inside a torch.save archive (as `.format_version` and `.storage_alignment`
  were once added) are ignored: it reads."""

import pickle
import zipfile
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from conftest import cli_in_process
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

from neurontrain.checkpoint.formats import DCPSource, TorchSource

WEIGHT = torch.arange(6.0).reshape(2, 3)


@dataclass
class StorageMetaFromANewerRelease:
    """A class of torch.distributed.checkpoint.metadata as a newer release would define it (2.9 has none)."""

    checkpoint_id: str | None = None
    save_id: str | None = None


def dcp_dir(tmp_path, edit=None):
    """dcp.save of a small state dict (one process, no group), its .metadata then re-pickled after `edit`, as
    DCP's writer pickles it."""
    directory = tmp_path / "dcp"
    dcp.save({"model": {"w": WEIGHT}}, checkpoint_id=str(directory))
    if edit is not None:
        with open(directory / ".metadata", "rb") as f:
            metadata = pickle.load(f)
        edit(metadata)
        with open(directory / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
    return directory


def refused(capsys, path):
    """`checkpoint inspect PATH`: exit 2 and one line; the line."""
    code, out, err = cli_in_process(capsys, "checkpoint", "inspect", str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, out, err)
    return err


def test_dcp_metadata_naming_a_class_this_torch_lacks(tmp_path, capsys, monkeypatch):
    def newer(metadata):
        metadata.storage_meta = StorageMetaFromANewerRelease("ckpt", "save-1")

    monkeypatch.setattr(StorageMetaFromANewerRelease, "__module__", dcp_metadata.__name__)
    monkeypatch.setattr(
        dcp_metadata, StorageMetaFromANewerRelease.__name__, StorageMetaFromANewerRelease, raising=False
    )
    directory = dcp_dir(tmp_path, newer)
    monkeypatch.undo()  # the class is gone again, as in 2.9
    line = refused(capsys, directory)
    assert f"newer torch than {torch.__version__}" in line
    assert f"DCP format {CURRENT_DCP_VERSION}" in line  # what the file records, read past the missing class
    assert "torch.distributed.checkpoint.metadata.StorageMetaFromANewerRelease" in line
    assert "dcp_to_torch_save" in line and "safetensors" in line


def test_dcp_format_of_a_newer_major_version_is_refused(tmp_path, capsys):
    major = int(CURRENT_DCP_VERSION.split(".")[0]) + 1
    directory = dcp_dir(tmp_path, lambda m: setattr(m, "version", f"{major}.0.0"))
    line = refused(capsys, directory)
    assert f"DCP format {major}.0.0" in line and f"writes {CURRENT_DCP_VERSION}" in line


def test_dcp_metadata_with_fields_this_torch_does_not_know_reads(tmp_path, capsys):
    major, minor, *_ = CURRENT_DCP_VERSION.split(".")

    def newer(metadata):
        metadata.version = f"{major}.{int(minor) + 1}.0"
        metadata.mcore_data = {"sharded_backend": "torch_dist"}
        metadata.storage_meta.new_field = "from a newer release"
        next(iter(metadata.state_dict_metadata.values())).new_field = 1

    directory = dcp_dir(tmp_path, newer)
    assert torch.equal(DCPSource(directory, None).get("model.w"), WEIGHT)
    code, out, err = cli_in_process(capsys, "checkpoint", "inspect", str(directory))
    assert code == 0 and "dcp" in out, err


def torch_file(tmp_path, edit=None, extra=None):
    """torch.save of a small state dict, its archive rewritten record by record through `edit(name, bytes)`."""
    path = tmp_path / "model.pt"
    torch.save({"w": WEIGHT}, path)
    if edit is None and extra is None:
        return path
    with zipfile.ZipFile(path) as archive:
        records = [(name, archive.read(name)) for name in archive.namelist()]
    prefix = records[0][0].split("/")[0]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            archive.writestr(name, edit(name.removeprefix(prefix + "/"), data) if edit else data)
        for name, data in (extra or {}).items():
            archive.writestr(f"{prefix}/{name}", data)
    return path


def test_torch_archive_of_a_newer_format_version(tmp_path, capsys):
    def newer(name, data):
        return str(int(data) + 1000).encode() + b"\n" if name == "version" else data

    written = int(zipfile.ZipFile(torch_file(tmp_path)).read("model/version"))
    line = refused(capsys, torch_file(tmp_path, newer))
    assert f"archive format version {written + 1000}" in line and "this torch reads up to" in line
    assert f"newer torch than {torch.__version__}" in line and "safetensors" in line


def test_torch_pickle_naming_a_torch_function_this_torch_lacks(tmp_path, capsys):
    assert hasattr(torch._utils, "_rebuild_tensor_v2") and not hasattr(torch._utils, "_rebuild_tensor_v4")

    def newer(name, data):
        return data.replace(b"_rebuild_tensor_v2", b"_rebuild_tensor_v4") if name == "data.pkl" else data

    line = refused(capsys, torch_file(tmp_path, newer))
    assert "torch._utils._rebuild_tensor_v4" in line and f"newer torch than {torch.__version__}" in line


def test_a_class_of_another_package_is_not_blamed_on_torch(tmp_path, capsys):
    def foreign(name, data):
        return data.replace(b"collections\nOrderedDict", b"mytrainer.state\nTrainState") if name == "data.pkl" else data

    line = refused(capsys, torch_file(tmp_path, foreign))
    assert "newer torch" not in line and "other than tensors" in line


def test_torch_archive_with_records_this_torch_does_not_know_reads(tmp_path):
    path = torch_file(tmp_path, extra={".data/a_newer_record": b"1"})
    assert torch.equal(TorchSource([path], None, "t").get("w"), WEIGHT)
