"""Pure parts of driving the Neuron runtime's cache: where it looks, what we export, module states, flag checks;
and the stand-in compiler refusing what the real one refuses.

The tests here start processes; the in-process ones are in tests/unit/test_runtime_cache_pure.py."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

STANDIN_CC = str(REPO / "tests" / "standin" / "neuronx-cc")


def _cc(tmp_path, *args):
    hlo = tmp_path / "m.hlo_module.pb"
    hlo.write_bytes(b"module")
    env = {**os.environ, "STANDIN_CC_SECONDS": "0"}
    return subprocess.run(
        [
            sys.executable,
            STANDIN_CC,
            "compile",
            "--framework=XLA",
            str(hlo),
            "--target=trn1",
            "--output",
            str(tmp_path / "m.neff"),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
    )


@pytest.mark.parametrize("flag", ["--cache_dir=/tmp/x", "--retry_failed_compilation", "--log_level=INFO", "--bogus"])
def test_standin_compiler_refuses_what_neuronx_cc_does_not_know(tmp_path, flag):
    res = _cc(tmp_path, flag)
    assert res.returncode == 2 and "unrecognized arguments" in res.stderr


def test_standin_compiler_accepts_its_real_options(tmp_path):
    res = _cc(tmp_path, "--model-type", "transformer", "-O1", "--auto-cast=none", "--verbose=35")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "m.neff").read_bytes().startswith(b"NEFF")
