"""The native backend's plan and selection, and the guard's use of what the compiler says, without compiling."""

import os

import pytest
from bad_input import assert_one_line_usage_error
from conftest import RECIPES, cli_in_process

from neurontrain.backends import select_backend
from neurontrain.backends.native import CPU_TARGET, native_target
from neurontrain.commands.arguments import backend_choices
from neurontrain.errors import UsageError
from neurontrain.loop.guard import RecompilationGuard
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe

SMALL = [
    "data.train_samples=200",
    "data.eval_samples=16",
    "train.max_steps=8",
    "train.schedule.warmup_steps=1",
    "data.buckets=[32,64,128]",
    "data.packing=off",  # several buckets: several graphs
]


@pytest.mark.parametrize("accum", [1, 2])
def test_native_plans_the_model_graphs_only(accum: int):
    recipe = load_recipe(RECIPES / "tiny-llama-clm.yaml", [*SMALL, f"train.grad_accum={accum}"])
    eager, native = make_plan(recipe, "eager"), make_plan(recipe, "native")
    assert native.train_lengths_used == eager.train_lengths_used  # the same plan: buckets and batch order
    train = "train-micro" if accum > 1 else "train"
    model_keys = [k for k in eager.expected_graphs() if k[0] in (train, "eval")]
    assert native.expected_graphs() == model_keys and len(model_keys) > 2  # several train lengths and eval
    assert ("setup",) in eager.expected_graphs() and ("setup",) not in native.expected_graphs()
    assert (("optimizer",) in eager.expected_graphs()) == (accum > 1)
    assert ("optimizer",) not in native.expected_graphs()


def test_native_data_parallel_plans_the_same_graphs_and_refuses_zero1_and_ddp_over_tp():
    recipe = load_recipe(RECIPES / "tiny-llama-clm.yaml", SMALL)
    two = make_plan(recipe, "native", world=2)
    assert not two.split_step and all(key[0] in ("train", "eval") for key in two.expected_graphs())
    tp = make_plan(load_recipe(RECIPES / "tiny-llama-clm.yaml", [*SMALL, "parallel.tp=2"]), "native", world=2)
    assert (tp.world, tp.tp, tp.fsdp) == (1, 2, False) and tp.expected_graphs() == two.expected_graphs()
    assert "mesh: dp 1 x tp 2 (no FSDP2 x TP)" in tp.notes
    two_d = make_plan(
        load_recipe(RECIPES / "tiny-llama-clm.yaml", [*SMALL, "parallel.tp=2", "parallel.fsdp=true"]), "native", world=4
    )
    assert (two_d.world, two_d.tp, two_d.fsdp) == (2, 2, True) and "mesh: dp 2 x tp 2 (FSDP2 x TP)" in two_d.notes
    with pytest.raises(UsageError, match="parallel.tp: 2 on 4 workers needs parallel.fsdp: true"):
        make_plan(load_recipe(RECIPES / "tiny-llama-clm.yaml", [*SMALL, "parallel.tp=2"]), "native", world=4)
    with pytest.raises(UsageError, match="parallel.tp: 4 does not divide llama's 8 attention heads and 2 key/value"):
        make_plan(load_recipe(RECIPES / "tiny-llama-clm.yaml", [*SMALL, "parallel.tp=4"]), "native", world=4)
    with pytest.raises(UsageError, match="backend native: train.zero1 is not built"):
        make_plan(load_recipe(RECIPES / "tiny-llama-clm.yaml", [*SMALL, "train.zero1=true"]), "native", world=2)


class _Result:
    def __init__(self, code: int, err: str) -> None:
        self.returncode, self.stderr = code, err


NOT_YET = {
    "precompile target neuron": (
        ["precompile", "--set", "runtime.backend=native", "--target", "neuron"],
        "--target neuron is the Neuron runtime of the XLA path",
    ),
}


@pytest.mark.parametrize("case", sorted(NOT_YET))
def test_what_native_does_not_do_yet_is_a_one_line_usage_error(case: str, capsys):
    args, expected = NOT_YET[case]
    code, _, err = cli_in_process(capsys, args[0], str(RECIPES / "tiny-llama-clm.yaml"), *args[1:])
    assert_one_line_usage_error(_Result(code, err), expected)


def test_native_selects_the_cpu_and_inductor_without_neuron_devices(monkeypatch):
    monkeypatch.setenv("USE_TORCH_XLA", "1")
    assert native_target() == CPU_TARGET
    backend = select_backend("native")
    assert (backend.is_xla, backend.is_native, backend.compiler, str(backend.device)) == (
        False,
        True,
        "inductor",
        "cpu",
    )
    assert backend.collectives == "gloo" and not backend.reloads_executables
    assert os.environ["USE_TORCH_XLA"] == "0"  # transformers must not import torch_xla for a native run
    assert "native" in backend_choices(eager=False) and "eager" not in backend_choices(eager=False)


def test_the_guard_attaches_only_the_new_reasons_to_an_unexpected_graph():
    compiles, notes = [0], [["graph break: first"], ["recompiled: size mismatch"]]
    reports: list[str] = []
    guard = RecompilationGuard(
        [("train", 8)], "warn", lambda: compiles[0], lambda: 0, reports.append, explain=lambda: notes.pop(0)
    )
    compiles[0] = 1
    guard.after_sync(("train", 8), 1)  # planned: its notes are read and not reported
    guard.after_sync(("train", 8), 2)  # nothing compiled: the notes are not read
    assert guard.unexpected == [] and notes == [["recompiled: size mismatch"]]
    compiles[0] = 2
    guard.after_sync(("train", 16), 3)
    [event] = guard.unexpected
    assert (event["reason"], event["why"]) == ("not in the plan", ["recompiled: size mismatch"])
    assert len(reports) == 1 and reports[0].endswith("1 compile(s); recompiled: size mismatch")
