"""Native precompile and cache, end to end with torch_xla unimportable: `precompile --backend native` pushes the
plan's compile artifacts to the local S3 server; a run in a fresh process, with a fresh local cache pulled from
the server and a fresh empty inductor cache, takes every planned graph from the artifacts and compiles none;
a run given the precompile's entry with flipped bytes refuses it, loads nothing and compiles every graph (the
control).

One precompile and two runs (side by side) serve every test (module-scoped); each process has its own fresh
empty inductor cache (TORCHINDUCTOR_CACHE_DIR), so a graph-cache hit can only come from the loaded artifacts.
"""

import shutil
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest
from conftest import RECIPES, cli_in_process, read_json, run_cli
from torch_xla_blocker import without_torch_xla

pytestmark = pytest.mark.slow

RECIPE = str(RECIPES / "tiny-llama-clm.yaml")
SETS = []
for item in ("train.max_steps=2", "train.schedule.warmup_steps=1", "checkpoint.every=0"):
    SETS += ["--set", item]
PLANNED = 2  # train 128 and eval 128 (the plan's keys on native)


def _flip_bytes(path) -> None:
    data = bytearray(path.read_bytes())
    for i in (len(data) // 3, len(data) // 2):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def cached(tmp_path_factory, s3_server) -> dict:
    root = tmp_path_factory.mktemp("native-cache")
    blocker = without_torch_xla(root / "blocker")
    env = {**s3_server, **blocker}
    credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=s3_server["AWS_ENDPOINT_URL"], **credentials)
    s3.create_bucket(Bucket="native-cache")
    url = "s3://native-cache/team"
    precompile = run_cli(
        "precompile", RECIPE, "--backend", "native", "--cache", url, "--local", str(root / "precompile-local"),
        *SETS, "--json", str(root / "precompile.json"),
        env={**env, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-precompile")},
    )  # fmt: skip
    assert precompile.returncode == 0, precompile.stderr[-3000:]
    shutil.copytree(root / "precompile-local", root / "damaged")
    [entry] = (root / "damaged" / "native").iterdir()
    _flip_bytes(entry / "artifacts.bin")
    with ThreadPoolExecutor(2) as pool:  # the two runs are independent: at the same time
        warm = pool.submit(
            run_cli, "run", RECIPE, "--backend", "native", "--set", f"runtime.compile_cache={url}", *SETS,
            "--output-dir", str(root / "warm"),
            env={**env, "NEURONTRAIN_CACHE_DIR": str(root / "pulled"), "TORCHINDUCTOR_CACHE_DIR": str(root / "ind-warm")},  # noqa: E501
        )  # fmt: skip
        control = pool.submit(
            run_cli, "run", RECIPE, "--backend", "native", "--set", f"runtime.compile_cache={root / 'damaged'}", *SETS,
            "--output-dir", str(root / "control"), env={**env, "TORCHINDUCTOR_CACHE_DIR": str(root / "ind-control")},
        )  # fmt: skip
        warm, control = warm.result(), control.result()
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert control.returncode == 0, control.stderr[-3000:]
    return {"root": root, "warm": warm, "control": control, "entry": f"native/{entry.name}"}


def test_precompile_compiles_every_planned_graph_and_keeps_the_artifacts(cached):
    report = read_json(cached["root"] / "precompile.json")
    assert (report["planned_graphs"], report["graphs_compiled"], report["entry"]) == (PLANNED, PLANNED, cached["entry"])
    assert report["cache_counters"]["autograd_cache_miss"] == PLANNED and report["artifact_bytes"] > 0
    assert [g["key"] for g in report["graphs"]] == [["train", 128], ["eval", 128]]


def test_a_warm_run_from_the_s3_cache_takes_every_planned_graph_from_it(cached):
    summary = read_json(cached["root"] / "warm" / "summary.json")
    native = summary["compile_cache"]["native"]
    assert summary["compile_cache"]["pulled"]["entries"] == 1 and native["entry"] == cached["entry"]
    assert native["loaded"] and native["refused"] is None
    assert (native["graphs_from_cache"], native["graphs_compiled"]) == (PLANNED, 0)
    assert native["counters"]["fxgraph_cache_miss"] == 0
    assert (summary["compilations"], summary["expected_graphs"], summary["unexpected_graphs"]) == (PLANNED, PLANNED, 0)
    assert summary["final_loss"] < summary["first_loss"]


def test_a_damaged_artifact_is_refused_not_loaded_and_the_run_compiles(cached):
    summary = read_json(cached["root"] / "control" / "summary.json")
    native = summary["compile_cache"]["native"]
    assert not native["loaded"] and native["refused"] == "artifacts.bin altered (sha256 mismatch)"
    assert (native["graphs_from_cache"], native["graphs_compiled"]) == (0, PLANNED)
    warning = [line for line in cached["control"].stderr.splitlines() if "refused" in line]
    assert warning == [
        f"neurontrain: compile cache: refused {cached['entry']}: artifacts.bin altered (sha256 mismatch); not loaded, "
        "the run compiles its graphs"
    ]
    assert summary["unexpected_graphs"] == 0 and summary["steps"] == 2


def test_no_process_looked_for_torch_xla(cached):
    log = (cached["root"] / "blocker" / "blocked.log").read_text()
    assert log.count("active in") >= 3 and "refused" not in log, log


def test_cache_status_shows_the_entry_and_its_damage(cached, capsys, monkeypatch):
    monkeypatch.setenv("USE_TORCH_XLA", "1")  # selecting native sets it to 0 for transformers: keep that here
    local = str(cached["root"] / "damaged")
    code, out, _ = cli_in_process(capsys, "cache", "status", RECIPE, "--backend", "native", "--local", local, *SETS)
    assert code == 0 and f"{cached['entry']}  local: refused (artifacts.bin altered (sha256 mismatch))" in out, out
