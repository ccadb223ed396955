"""`auto` on a CUDA host without torch-xla: eager or native by the priced time of the whole job (a short job pays
native's compile for nothing, a long one earns it back); `--backend` decides when given. The plans are made here as
a CUDA host makes them (the native target's compile figure is inductor-on-CUDA's); nothing is compiled."""

import json

import pytest
from conftest import RECIPES, cli_in_process

from neurontrain.commands import run as run_command
from neurontrain.plan import buckets as plan_buckets
from neurontrain.plan.backend_choice import PricedJob, choose_job_backend, choose_priced, cuda_auto_host
from neurontrain.recipe import load_recipe

BERT_BASE = [  # the GPU reference run's shape (benchmarks/gpu_reference.py), without evaluation
    "model.config.hidden_size=768",
    "model.config.num_hidden_layers=12",
    "model.config.num_attention_heads=12",
    "model.config.intermediate_size=3072",
    "model.config.max_position_embeddings=512",
    "data.batch_size=32",
    "data.train_samples=2000",
    "data.eval_samples=0",
    "train.precision=bf16",
    "train.schedule.warmup_steps=10",
]


@pytest.fixture
def on_cuda(monkeypatch):
    """The native backend's target as on a GPU host: its plan and its compile figure are inductor-on-CUDA's."""
    monkeypatch.setattr(plan_buckets, "native_device_type", lambda: "cuda")


def _bert_base(steps: int):
    return load_recipe(RECIPES / "tiny-bert-classification.yaml", [*BERT_BASE, f"train.max_steps={steps}"])


def test_a_short_job_takes_eager_and_a_long_one_native(on_cuda):
    short, long = choose_job_backend(_bert_base(150)), choose_job_backend(_bert_base(20_000))
    assert (short.backend, long.backend) == ("eager", "native")
    for choice in (short, long):
        eager, native = choice.priced
        assert (eager.backend, eager.graphs, eager.compile_seconds) == ("eager", 0, 0.0)
        assert native.backend == "native" and native.graphs == 1 and native.compile_seconds == pytest.approx(39.5)
        assert eager.packed and native.packed  # both pack (data.packing: auto), native too
        assert choice.reason.startswith(f"backend auto -> {choice.backend}: the whole job priced on this GPU")
        assert "native 40 s compiling 1 graph(s) + " in choice.reason
    assert short.priced[1].seconds > short.priced[0].seconds and long.priced[1].seconds < long.priced[0].seconds


def test_the_cheaper_priced_job_wins():
    eager = PricedJob("eager", 0, 0.0, 100, 9.0, True)
    native = PricedJob("native", 1, 5.0, 100, 3.0, True)
    assert choose_priced([eager, native]).backend == "native"
    assert choose_priced([eager, PricedJob("native", 1, 7.0, 100, 3.0, False)]).backend == "eager"


def test_run_dry_run_on_a_cuda_host_says_which_backend_and_why_unless_one_is_given(on_cuda, monkeypatch, capsys):
    assert not cuda_auto_host("eager") and not cuda_auto_host("native")  # a backend given is never second-guessed
    monkeypatch.setattr(run_command, "cuda_auto_host", lambda requested: requested == "auto")
    recipe = str(RECIPES / "tiny-bert-classification.yaml")
    sets = [arg for item in [*BERT_BASE, "train.max_steps=150"] for arg in ("--set", item)]
    code, out, err = cli_in_process(capsys, "run", recipe, *sets, "--dry-run")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["backend"] == "eager" and plan["backend_choice"].startswith("backend auto -> eager")
    code, out, err = cli_in_process(capsys, "run", recipe, *sets, "--dry-run", "--backend", "native")
    assert code == 0 and json.loads(out)["backend"] == "native" and "backend_choice" not in json.loads(out)
