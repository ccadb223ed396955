"""Native tensor parallel on CPU with gloo (DTensors, torch.compile, no stand-in): tiny Llama, Qwen3 and Mistral at
TP 2 on two torchrun workers, and tiny Llama at FSDP2 2 x TP 2 on four, each against one eager worker on the same
global batch for 20 steps (`neurontrain compare` within 1e-5). A TP 2 worker killed with SIGKILL restarts from its
DCP checkpoint and ends with the uninterrupted run's weights; that checkpoint migrates to a Hugging Face folder
that `checkpoint verify --logits` finds equal to the TP run's export and, within 1e-5, to the eager worker's.

The runs are made once (module fixture) and shared by the tests; each compiles one graph (TP alone: the whole
model) or one per layer (FSDP2 x TP)."""

import pytest
import yaml
from conftest import RECIPES, cli_in_process, read_json, read_metrics, run_cli, run_killing_a_worker
from families import tiny_config_values

pytestmark = pytest.mark.slow

STEPS, EVERY, ROWS, LAYERS = 20, 10, 16, 2
FAMILIES = ("llama", "qwen3", "mistral")
COMMON = [
    "--no-preflight",
    *("--set", f"train.max_steps={STEPS}", "--set", "train.log_every=1", "--set", "train.precision=fp32"),
    *("--set", "train.eval_at_end=false", "--set", "train.schedule.warmup_steps=1"),
    *("--set", "data.train_samples=400", "--set", "data.max_length=64", "--set", "data.buckets=[64]"),
    *("--set", "data.packing=off"),  # batches of data.batch_size samples on 1, 2 and 4 workers alike
]
EAGER = ["--backend", "eager", "--set", f"data.batch_size={ROWS}", "--set", "checkpoint.every=0"]
TP = ["--backend", "native", "--nproc-per-node", "2", "--set", "parallel.tp=2", "--set", f"data.batch_size={ROWS}"]
FSDP_TP = [
    *("--backend", "native", "--nproc-per-node", "4", "--set", "parallel.tp=2", "--set", "parallel.fsdp=true"),
    *("--set", f"data.batch_size={ROWS // 2}", "--set", "checkpoint.every=0"),
]
WEIGHTS = "model/model.safetensors"


def _recipe(root, model_type: str) -> str:
    """The tiny Llama recipe with the family's tiny config (tests/families.py); Llama's own recipe as shipped."""
    if model_type == "llama":
        return str(RECIPES / "tiny-llama-clm.yaml")
    recipe = yaml.safe_load((RECIPES / "tiny-llama-clm.yaml").read_text())
    recipe["model"]["config"] = tiny_config_values(model_type)
    path = root / f"{model_type}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per family one eager worker of 16 rows a step and a TP 2 pair of 16 (Llama's checkpointing every EVERY
    steps); Llama also on FSDP2 2 x TP 2 workers of 8 rows."""
    root = tmp_path_factory.mktemp("native_tp")
    plans = [(f"{f}-eager", f, EAGER) for f in FAMILIES]
    plans += [(f"{f}-tp", f, [*TP, "--set", f"checkpoint.every={EVERY if f == 'llama' else 0}"]) for f in FAMILIES]
    plans.append(("llama-fsdp-tp", "llama", FSDP_TP))
    for name, family, extra in plans:
        result = run_cli("run", _recipe(root, family), *COMMON, *extra, "--output-dir", str(root / name))
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def _matches_eager(runs, family: str, name: str, capsys) -> dict:
    """`neurontrain compare` of the run against its family's eager worker: final loss within 1e-5, and every step's
    loss within 1e-5 too; the run's summary."""
    eager, run = runs / f"{family}-eager", runs / name
    code, out, err = cli_in_process(
        capsys, "compare", str(eager), str(run), "--metric", "final_loss", "--by", "steps", "--tolerance", "1e-5"
    )
    print(out)
    assert code == 0, out + err
    one, two = _losses(eager), _losses(run)
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    assert max(abs(one[s] - two[s]) / abs(one[s]) for s in one) <= 1e-5
    assert two[STEPS] < two[1]
    summary = read_json(run / "summary.json")
    assert summary["backend"] == "native" and summary["effective_batch"] == ROWS
    assert summary["unexpected_graphs"] == 0
    return summary


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_matches_one_eager_worker_on_the_same_global_batch(runs, family, capsys):
    summary = _matches_eager(runs, family, f"{family}-tp", capsys)
    assert summary["compilations"] == summary["expected_graphs"] == 1  # the whole model, collectives inside
    # each TP rank holds about half of the weights and of AdamW's moments (the norms are whole on both)
    whole = read_json(runs / f"{family}-eager" / "summary.json")["device_bytes"][0]
    for kind in ("parameters", "optimizer"):
        assert 0.5 * whole[kind] <= summary["device_bytes"][0][kind] <= 0.56 * whole[kind], kind


def test_fsdp2_x_tp2_on_four_workers_matches_one_eager_worker(runs, capsys):
    summary = _matches_eager(runs, "llama", "llama-fsdp-tp", capsys)
    assert summary["world_size"] == 2 and summary["expected_graphs"] == LAYERS
    assert 1 <= summary["compilations"] == summary["distinct_graphs"] <= LAYERS
    whole = read_json(runs / "llama-eager" / "summary.json")["device_bytes"][0]
    for worker in summary["device_bytes"]:  # a quarter of each parameter, but the norms' FSDP2 halves
        assert 0.25 * whole["parameters"] <= worker["parameters"] <= 0.29 * whole["parameters"], worker


def test_sigkill_then_restart_ends_with_the_uninterrupted_weights_and_migrates(runs, tmp_path, capsys):
    out = tmp_path / "killed"
    recipe = _recipe(tmp_path, "llama")
    args = ["run", recipe, *COMMON, *TP, "--set", f"checkpoint.every={EVERY}", "--max-restarts", "1", "-o", str(out)]
    code, stderr = run_killing_a_worker(args, out, EVERY)
    assert code == 0, stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["restarts"] == 1 and summary["resumed_from_step"] in (EVERY, STEPS)
    assert summary["unexpected_graphs"] == 0
    assert (out / WEIGHTS).read_bytes() == (runs / "llama-tp" / WEIGHTS).read_bytes()

    shards = out / "checkpoints" / f"step_{STEPS:08d}" / "dcp"
    hf = tmp_path / "hf"
    code, _, err = cli_in_process(capsys, "checkpoint", "migrate", str(shards), str(hf), "--to", "gpu")
    assert code == 0, err[-2000:]
    code, text, err = cli_in_process(
        capsys, "checkpoint", "verify", str(hf), str(runs / "llama-tp" / "model"), "--logits", str(hf)
    )
    assert code == 0 and "logits max abs diff 0: EQUAL" in text, text + err[-2000:]
    eager = runs / "llama-eager" / "model"
    code, text, err = cli_in_process(
        capsys, "checkpoint", "verify", str(hf), str(eager), "--atol", "1e-5", "--logits", str(hf)
    )
    print(text)
    assert code == 0 and ": EQUAL" in text, text + err[-2000:]
