"""The command line in fresh processes: env, the Neuron backend without devices, --dry-run, start-up without torch."""

import json
import subprocess
import sys

from conftest import RECIPES, REPO, run_cli


def test_env_reports_backend_and_versions():
    result = run_cli("env", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    info = json.loads(result.stdout)
    assert info["backend"] == "xla-cpu" and info["collectives"] == "gloo"
    assert info["reloads_compiled_executables"] is False
    assert info["packages"]["torch"].startswith("2.9") and info["packages"]["torch-xla"].startswith("2.9")


def test_neuron_backend_without_devices_is_a_usage_error():
    result = run_cli("env", "--backend", "neuron")
    assert result.returncode == 2 and result.stderr.strip().startswith("neurontrain: error: backend neuron needs")


def test_dry_run_prints_plan_without_training(tmp_path):
    result = run_cli("run", str(RECIPES / "tiny-llama-clm.yaml"), "--dry-run", "--output-dir", str(tmp_path / "x"))
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads(result.stdout)
    assert plan["expected_graphs"][0] == ["setup"]
    assert {tuple(k) for k in plan["expected_graphs"]} >= {("train", n) for n in plan["buckets"]["used"]}
    # as shipped, the recipe packs (data.packing: auto): one row length, little padding, about 8 samples a step
    assert plan["buckets"]["mode"] == "packed" and plan["packing"]["padding_fraction"] < 0.05
    assert plan["world_size"] == 1 and plan["effective_batch"] == plan["packing"]["rows_per_step"] < 8
    assert not (tmp_path / "x").exists()


def test_help_submit_and_usage_errors_start_without_torch():
    """Only the chosen verb's module is imported: --help, no verb, an unknown verb, and submit's and health's
    usage errors never load torch (a few tenths of a second, against seconds for torch)."""
    code = (
        "import contextlib, io, sys\nfrom neurontrain.cli import main\n"
        "codes = []\n"
        "for argv in (['fly'], [], ['submit'], ['submit', 'slurm'], ['health', '--bogus'], ['--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            codes.append(main(argv))\n"
        "        except SystemExit as exc:\n"
        "            codes.append(exc.code)\n"
        "print(codes, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_xla', 'transformers')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[2, 2, 2, 2, 2, 0] []"
    assert all(line.startswith("neurontrain: error:") for line in done.stderr.strip().splitlines())
