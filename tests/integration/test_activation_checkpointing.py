"""Activation checkpointing through `neurontrain run` on XLA:CPU: the same losses and weights as without it,
one optimization barrier per checkpointed layer in every training graph (read from the HLO torch-xla itself
dumps for each sync, XLA_SAVE_TENSORS_FILE), no extra graphs and no host syncs. Each run is its own process."""

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import RECIPES, read_json, read_metrics, run_cli
from safetensors.torch import load_file

from neurontrain.parallel.checkpointing import checkpointed_layers

pytestmark = pytest.mark.slow

SHORT = ["--set", "checkpoint.every=0", "--set", "train.eval_at_end=false", "--set", "runtime.preflight=false"]
SHORT += ["--set", "train.log_every=1", "--set", "train.schedule.warmup_steps=0", "--set", "data.train_samples=200"]
# Llama: 3 layers and every_2 checkpoints layers 0 and 2 (the every_N selection shows in the barrier count).
# BERT keeps its dropout (0.1): the recompute must draw the same masks (seen in the weights), and the steps
# after it the same masks as a run without checkpointing (seen in the losses: torch-xla's checkpoint resets the
# RNG's base seed, and only the trainer's per-step seed keeps the later steps' draws the same).
CASES = {
    "llama": ("tiny-llama-clm", "every_2", 3, 4, ["--set", "checkpoint.save_final=false"]),
    "bert": ("tiny-bert-classification", "full", 2, 3, ["--set", "data.max_length=64"]),
}
_BARRIER = re.compile(r" opt-barrier\(")  # the instruction; its uses read `%opt-barrier.N`


def _run(tmp: Path, case: str, setting: str) -> Path:
    recipe, _, layers, steps, extra = CASES[case]
    out = tmp / f"{case}-{setting}"
    dump = tmp / f"{case}-{setting}.hlo"
    result = run_cli(
        "run",
        str(RECIPES / f"{recipe}.yaml"),
        "--output-dir",
        str(out),
        *SHORT,
        *extra,
        "--set",
        f"model.config.num_hidden_layers={layers}",
        "--set",
        f"train.max_steps={steps}",
        "--set",
        f"train.activation_checkpointing={setting}",
        env={"XLA_SAVE_TENSORS_FILE": str(dump), "XLA_SAVE_TENSORS_FMT": "hlo"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("actckpt")
    jobs = [(case, setting) for case, spec in CASES.items() for setting in ("none", spec[1])]
    with ThreadPoolExecutor(max_workers=2) as pool:  # the processes share the host's two cores
        outs = list(pool.map(lambda job: _run(tmp, *job), jobs))
    return dict(zip(jobs, outs))


def _barriers_per_graph(out: Path) -> list[int]:
    """Optimization barriers in each graph the run synced, in order (the first is the set-up graph)."""
    text = "".join(p.read_text() for p in sorted(out.parent.glob(f"{out.name}.hlo*")))
    graphs = text.split("## BEGIN_GRAPH")[1:]
    assert graphs, f"torch-xla dumped no graph for {out.name}"
    return [len(_BARRIER.findall(graph.split("## END_GRAPH")[0])) for graph in graphs]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("case", list(CASES))
def test_checkpointing_changes_no_loss_graph_count_or_sync(runs: dict, case: str):
    _, setting, layers, steps, _ = CASES[case]
    plain, checkpointed = runs[(case, "none")], runs[(case, setting)]
    assert len(_losses(plain)) == steps
    assert _losses(checkpointed) == _losses(plain)  # bit-identical: == on the floats, no tolerance
    before, after = read_json(plain / "summary.json"), read_json(checkpointed / "summary.json")
    assert after["compilations"] == before["compilations"] == before["expected_graphs"]  # the seed is no constant
    assert after["unexpected_graphs"] == before["unexpected_graphs"] == 0
    assert after["hidden_host_syncs"] == before["hidden_host_syncs"] == []
    expected = len(checkpointed_layers(setting, layers))
    assert expected > 0 and _barriers_per_graph(plain) == [0] * (steps + 1)
    assert _barriers_per_graph(checkpointed) == [0] + [expected] * steps  # set-up graph, then each step


def test_recompute_draws_the_same_dropout_masks(runs: dict):
    """BERT's dropout is on: after its steps the weights agree bit for bit only if every recompute in the
    backward pass drew the masks the forward pass drew, and every step the masks of the run without it."""
    plain = load_file(runs[("bert", "none")] / "model" / "model.safetensors")
    checkpointed = load_file(runs[("bert", "full")] / "model" / "model.safetensors")
    assert plain.keys() == checkpointed.keys()
    differing = [name for name in plain if not plain[name].equal(checkpointed[name])]
    assert differing == []
