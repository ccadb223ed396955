"""The s3:// compile cache against a real HTTP S3 endpoint (moto server on 127.0.0.1) through the CLI: `neurontrain
cache` in this process (each test's environment its own), in processes of their own where they run concurrently
or where a fresh process matters (credentials), and for precompile and the runs."""

import hashlib
import json
import os
import random
import subprocess
import sys

import pytest
from conftest import REPO, cli_in_process, read_json, run_cli, start_cli


def _fake_cache(root, seed, n_graphs=5, n_modules=3):
    """A local cache with recorded graphs, a manifest and compiled Neuron modules (random bytes)."""
    rng = random.Random(seed)
    for i in range(n_graphs):
        d = root / "graphs" / f"{i:032x}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "model.hlo_module.pb").write_bytes(rng.randbytes(rng.randint(100, 50_000)))
    for i in range(n_modules):
        d = root / "neuronxcc-2.21.18209.0+043b1bf7" / f"MODULE_{i:032x}+d41d8cd9"
        d.mkdir(parents=True, exist_ok=True)
        (d / "model.hlo_module.pb").write_bytes(rng.randbytes(2000))
        (d / "compile_flags.json").write_text("[]")
        (d / "model.neff").write_bytes(b"NEFF" + rng.randbytes(rng.randint(10, 300_000)))
        (d / "model.done").touch()
    (root / "manifests").mkdir(exist_ok=True)
    (root / "manifests" / f"tiny-{seed}.json").write_text(json.dumps({"seed": seed}))


def _tree(root):
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


@pytest.fixture
def cache_cli(capsys, monkeypatch):
    """`neurontrain cache ARGS` in this process, with `env` added to its environment: a CompletedProcess."""

    def cli(*args, env=None):
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        code, out, err = cli_in_process(capsys, "cache", *args)
        return subprocess.CompletedProcess(["neurontrain", "cache", *args], code, out, err)

    return cli


def test_push_pull_round_trip_is_byte_identical_and_second_pull_transfers_nothing(tmp_path, s3_bucket, cache_cli):
    bucket, _ = s3_bucket
    src, dst = tmp_path / "a", tmp_path / "b"
    _fake_cache(src, seed=1)
    url = f"s3://{bucket}/team/cache"
    push = cache_cli("push", "--cache", url, "--local", str(src))
    assert push.returncode == 0, push.stderr
    assert json.loads(push.stdout)["entries"] == 9
    pull = cache_cli("pull", "--cache", url, "--local", str(dst))
    assert pull.returncode == 0, pull.stderr
    assert json.loads(pull.stdout)["entries"] == 9
    assert _tree(src) == _tree(dst)
    again = cache_cli("pull", "--cache", url, "--local", str(dst))
    assert json.loads(again.stdout) == {"entries": 0, "objects": 0, "bytes": 0, "skipped": 9, "refused": []}
    repush = cache_cli("push", "--cache", url, "--local", str(src))
    assert json.loads(repush.stdout)["objects"] == 0 and json.loads(repush.stdout)["entries"] == 0
    ls = cache_cli("ls", "--cache", url, "--json")
    assert len(json.loads(ls.stdout)) == 9
    assert cache_cli("verify", "--cache", url).returncode == 0
    assert cache_cli("verify", "--local", str(dst)).returncode == 0


def test_four_concurrent_pushers_leave_no_corrupt_entry(tmp_path, s3_bucket, cache_cli):
    bucket, _ = s3_bucket
    url = f"s3://{bucket}/shared"
    roots = []
    for k in range(4):
        root = tmp_path / f"node{k}"
        _fake_cache(root, seed=7)  # the same entries on every node ...
        _fake_cache(root, seed=100 + k, n_graphs=2, n_modules=1)  # ... overwritten in part by node-specific bytes
        roots.append(root)
    procs = [start_cli("cache", "push", "--cache", url, "--local", str(r), "--workers", "4") for r in roots]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    verify = cache_cli("verify", "--cache", url)
    assert verify.returncode == 0, verify.stderr
    assert json.loads(verify.stdout)["problems"] == 0
    pulled = tmp_path / "pulled"
    assert cache_cli("pull", "--cache", url, "--local", str(pulled)).returncode == 0
    # every pulled entry is exactly one node's version of it, never a mix
    for entry in (pulled / "graphs").iterdir():
        mine = _tree(entry)
        assert any(_tree(r / "graphs" / entry.name) == mine for r in roots)
    for entry in pulled.glob("neuronxcc-*/MODULE_*"):
        mine = _tree(entry)
        assert any(_tree(r / entry.parent.name / entry.name) == mine for r in roots)


def _pushed(cache_cli, tmp_path, s3_bucket, seed, prefix):
    """A fake local cache pushed to s3://<bucket>/<prefix>: (bucket, client, local dir, url)."""
    bucket, client = s3_bucket
    src = tmp_path / "src"
    _fake_cache(src, seed=seed)
    url = f"s3://{bucket}/{prefix}"
    assert cache_cli("push", "--cache", url, "--local", str(src)).returncode == 0
    return bucket, client, src, url


def test_truncated_and_altered_objects_are_named_and_refused(tmp_path, s3_bucket, cache_cli):
    bucket, client, src, url = _pushed(cache_cli, tmp_path, s3_bucket, 3, "c")
    neff = next(src.glob("neuronxcc-*/MODULE_*/model.neff"))
    hlo = src / "graphs" / f"{2:032x}" / "model.hlo_module.pb"

    neff_key = f"c/blobs/{hashlib.sha256(neff.read_bytes()).hexdigest()}"
    hlo_key = f"c/blobs/{hashlib.sha256(hlo.read_bytes()).hexdigest()}"
    client.put_object(Bucket=bucket, Key=neff_key, Body=neff.read_bytes()[:-100])  # truncated
    flipped = bytearray(hlo.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=hlo_key, Body=bytes(flipped))  # one bit flipped
    verify = cache_cli("verify", "--cache", url)
    assert verify.returncode == 1
    assert neff_key in verify.stderr and "truncated" in verify.stderr
    assert hlo_key in verify.stderr and "altered" in verify.stderr
    dst = tmp_path / "dst"
    pull = cache_cli("pull", "--cache", url, "--local", str(dst))
    assert pull.returncode == 1
    assert "refused" in pull.stderr and pull.stderr.count("refused") == 2
    assert not (dst / "graphs" / f"{2:032x}").exists()
    assert not (dst / neff.parent.parent.name / neff.parent.name).exists()
    assert json.loads(pull.stdout)["entries"] == 7
    assert not [p for p in dst.rglob("*") if p.name.startswith((".blob-", ".pull-"))]


def test_prune_removes_old_entries_and_their_objects(tmp_path, s3_bucket, cache_cli):
    bucket, client, src, url = _pushed(cache_cli, tmp_path, s3_bucket, 5, "p")
    assert json.loads(cache_cli("prune", "--cache", url, "--older-than", "1d").stdout)["entries_removed"] == 0
    result = json.loads(cache_cli("prune", "--cache", url, "--older-than", "0s").stdout)
    assert result["entries_removed"] == 9 and result["objects_removed"] > 0
    assert client.list_objects_v2(Bucket=bucket, Prefix="p/").get("KeyCount", 0) == 0
    local = json.loads(cache_cli("prune", "--local", str(src), "--older-than", "0s").stdout)
    assert local["entries_removed"] == 9 and not any(src.rglob("model.neff"))


def test_bad_urls_missing_buckets_and_credentials_exit_2(tmp_path, s3_server, cache_cli):
    env = {**s3_server}
    cases = [
        (["push", "--cache", "s3://"], "bad cache URL"),
        (["pull", "--cache", "s3://ab/x"], "bad bucket name"),
        (["ls", "--cache", "http://example.com/x"], "bad cache URL"),
        (["pull", "--cache", "s3://no-such-bucket-here/x", "--local", str(tmp_path)], "does not exist"),
        (["push"], "needs --cache s3://"),
    ]
    for args, message in cases:
        res = cache_cli(*args, env=env)
        assert res.returncode == 2, (args, res.stderr)
        assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    # in a process of its own: boto3 keeps the credentials its default session found in this one
    no_creds = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    no_creds.update(
        {
            "AWS_ENDPOINT_URL": s3_server["AWS_ENDPOINT_URL"],
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
            "AWS_CONFIG_FILE": str(tmp_path / "none"),
        }
    )
    res = subprocess.run(
        [sys.executable, "-m", "neurontrain", "cache", "ls", "--cache", "s3://some-bucket/x"],
        cwd=REPO,
        env=no_creds,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "no AWS credentials" in res.stderr, res.stderr


@pytest.mark.slow
def test_fleet_precompile_once_then_status_and_run_elsewhere(tmp_path, s3_bucket, recipes):
    """One node precompiles into s3://; another sees the graphs with `cache status` and its run pulls the
    manifest and checks every graph it compiles against it."""
    bucket, _ = s3_bucket
    url = f"s3://{bucket}/fleet"
    recipe = str(recipes / "tiny-llama-clm.yaml")
    small = ["--set", "train.max_steps=6", "--set", "checkpoint.every=0", "--set", "train.eval_every=3"]
    pre = run_cli(
        "precompile",
        recipe,
        *small,
        "--cache",
        url,
        "--local",
        str(tmp_path / "node1"),
        "--json",
        str(tmp_path / "pre.json"),
        env=dict(os.environ),
    )
    assert pre.returncode == 0, pre.stderr
    report = read_json(tmp_path / "pre.json")
    ids = {g["graph_id"] for g in report["graphs"]}
    status = run_cli(
        "cache",
        "status",
        recipe,
        *small,
        "--cache",
        url,
        "--local",
        str(tmp_path / "node2"),
        "--json",
        env=dict(os.environ),
    )
    assert status.returncode == 0, status.stderr
    listed = json.loads(status.stdout)
    assert {g["graph_id"] for g in listed["graphs"]} == ids
    assert all("remote" in g["hlo"] for g in listed["graphs"])
    run = run_cli(
        "run",
        recipe,
        *small,
        "--set",
        f"runtime.compile_cache={url}",
        "--output-dir",
        str(tmp_path / "run"),
        env={**os.environ, "NEURONTRAIN_CACHE_DIR": str(tmp_path / "node3")},
    )
    assert run.returncode == 0, run.stderr
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["checked_against_manifest"] and summary["unexpected_graphs"] == 0
    assert summary["compile_cache"]["pulled"]["entries"] == 1 + len(ids)
    assert sorted(p.name for p in (tmp_path / "node3" / "graphs").iterdir()) == sorted(ids)
