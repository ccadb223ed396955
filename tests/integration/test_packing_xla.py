"""Issue 15's isolation and equivalence tests on XLA:CPU (eager CPU: tests/unit/test_packing_isolation.py): one
fresh process (tests/packing_xla_worker.py) runs tiny BERT and tiny Llama on packed rows on the XLA device."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "packing_xla_worker.py"


@pytest.fixture(scope="module")
def report() -> dict:
    path = os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, str(WORKER)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["device"].startswith("xla") and report["compiles"] > 0, report  # it ran on XLA
    return report


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_changing_one_document_leaves_the_others_unchanged_on_xla(report, model_type):
    assert report[model_type]["isolation"] <= 1e-6, report


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_without_document_boundaries_a_changed_document_reaches_the_others_on_xla(report, model_type):
    assert report[model_type]["without_boundaries"] > 1e-2, report


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_packed_documents_match_each_document_run_alone_on_xla(report, model_type):
    diffs = report[model_type]["equivalence"]
    assert max(diffs.values()) <= 1e-5, report
