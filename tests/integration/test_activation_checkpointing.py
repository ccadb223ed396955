"""Activation checkpointing through `neurontrain run` on XLA:CPU: the same losses and weights as without it,
one optimization barrier per checkpointed layer in every training graph (read from the HLO torch-xla itself
dumps for each sync, XLA_SAVE_TENSORS_FILE), no extra graphs and no host syncs. Two
processes, each `neurontrain run` of tiny Llama then of tiny BERT (they share no graph: each run compiles all of
its own), one without checkpointing and one with it."""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import RECIPES, REPO, read_json, read_metrics
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


# `neurontrain run` for each argument list in argv[1] (JSON), one after the other in this process
RUNS = "import json, sys; from neurontrain.cli import main; sys.exit(max(main(a) for a in json.loads(sys.argv[1])))"


def _args(tmp: Path, case: str, setting: str) -> list[str]:
    recipe, _, layers, steps, extra = CASES[case]
    out = tmp / f"{case}-{setting}"
    sets = [f"model.config.num_hidden_layers={layers}", f"train.max_steps={steps}"]
    sets += [f"train.activation_checkpointing={setting}"]
    sets = [arg for value in sets for arg in ("--set", value)]
    return ["run", str(RECIPES / f"{recipe}.yaml"), "--output-dir", str(out), *SHORT, *extra, *sets]


def _runs(tmp: Path, jobs: list[tuple[str, str]], dump: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_SAVE_TENSORS_FILE": str(dump), "XLA_SAVE_TENSORS_FMT": "hlo"}
    # at XLA's own optimization level, as users run: the recompute is bit-identical to the first forward there
    # (and at level 1); at the suite's level 0 (conftest.py) tiny BERT's recomputed dropout forward is not
    env["XLA_FLAGS"] = re.sub(r"--xla_backend_optimization_level=\d+", "", env.get("XLA_FLAGS", "")).strip()
    argv = json.dumps([_args(tmp, *job) for job in jobs])
    result = subprocess.run([sys.executable, "-c", RUNS, argv], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each run's output directory and the graphs its process dumped (torch-xla reads XLA_SAVE_TENSORS_FILE once
    a process: the Llama run's come first)."""
    tmp = tmp_path_factory.mktemp("actckpt")
    pairs = [[(case, "none") for case in CASES], [(case, spec[1]) for case, spec in CASES.items()]]
    with ThreadPoolExecutor(max_workers=2) as pool:  # the processes share the host's two cores
        list(pool.map(lambda i: _runs(tmp, pairs[i], tmp / f"graphs-{i}.hlo"), range(2)))
    out = {}
    for i, jobs in enumerate(pairs):
        graphs = _graphs(tmp, f"graphs-{i}.hlo")
        llama_graphs = CASES["llama"][3] + 1  # the set-up graph, then one a step
        split = {"llama": graphs[:llama_graphs], "bert": graphs[llama_graphs:]}
        out.update({job: (tmp / f"{job[0]}-{job[1]}", split[job[0]]) for job in jobs})
    return out


def _graphs(tmp: Path, name: str) -> list[str]:
    text = "".join(p.read_text() for p in sorted(tmp.glob(f"{name}*")))
    graphs = text.split("## BEGIN_GRAPH")[1:]
    assert graphs, f"torch-xla dumped no graph in {name}"
    return [graph.split("## END_GRAPH")[0] for graph in graphs]


def _barriers_per_graph(graphs: list[str]) -> list[int]:
    """Optimization barriers in each graph the run synced, in order (the first is the set-up graph)."""
    return [len(_BARRIER.findall(graph)) for graph in graphs]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("case", list(CASES))
def test_checkpointing_changes_no_loss_graph_count_or_sync(runs: dict, case: str):
    _, setting, layers, steps, _ = CASES[case]
    (plain, plain_graphs), (checkpointed, checkpointed_graphs) = runs[(case, "none")], runs[(case, setting)]
    assert len(_losses(plain)) == steps
    assert _losses(checkpointed) == _losses(plain)  # bit-identical: == on the floats, no tolerance
    before, after = read_json(plain / "summary.json"), read_json(checkpointed / "summary.json")
    assert after["compilations"] == before["compilations"] == before["expected_graphs"]  # the seed is no constant
    assert after["unexpected_graphs"] == before["unexpected_graphs"] == 0
    assert after["hidden_host_syncs"] == before["hidden_host_syncs"] == []
    expected = len(checkpointed_layers(setting, layers))
    assert expected > 0 and _barriers_per_graph(plain_graphs) == [0] * (steps + 1)
    assert _barriers_per_graph(checkpointed_graphs) == [0] + [expected] * steps  # set-up graph, then each step


def test_recompute_draws_the_same_dropout_masks(runs: dict):
    """BERT's dropout is on: after its steps the weights agree bit for bit only if every recompute in the
    backward pass drew the masks the forward pass drew, and every step the masks of the run without it."""
    plain = load_file(runs[("bert", "none")][0] / "model" / "model.safetensors")
    checkpointed = load_file(runs[("bert", "full")][0] / "model" / "model.safetensors")
    assert plain.keys() == checkpointed.keys()
    differing = [name for name in plain if not plain[name].equal(checkpointed[name])]
    assert differing == []
