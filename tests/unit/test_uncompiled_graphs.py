"""The recompilation guard reports a planned graph that ran without compiling: TorchDynamo, past its
`recompile_limit`, runs a new shape eagerly without an error (measured on a GPU: 3 of 6 planned bucket graphs
compiled, the rest ran eagerly with the guard silent)."""

import pytest
import torch
import torch._dynamo

from neurontrain.backends.native import DynamoRecords
from neurontrain.errors import RecompilationError
from neurontrain.loop.guard import RecompilationGuard


@pytest.fixture
def limit_of_one():
    config = torch._dynamo.config
    saved = (config.recompile_limit, config.accumulated_recompile_limit)
    torch._dynamo.reset()
    config.recompile_limit = 1
    yield
    config.recompile_limit, config.accumulated_recompile_limit = saved
    torch._dynamo.reset()


def _planned_run(mode: str, reports: list[str]) -> RecompilationGuard:
    """Two planned lengths through a compiled function that TorchDynamo may compile only once."""

    @torch.compile(backend="eager", dynamic=False)
    def step(x):
        return (x * 2).sum()

    records = DynamoRecords()
    guard = RecompilationGuard(
        [("train", 8), ("train", 16)], mode, records.graphs, lambda: 0, reports.append, compiles_new_keys=True
    )
    for step_number, length in enumerate([8, 16, 8, 16]):
        step(torch.ones(2, length))
        guard.after_sync(("train", length), step_number, {"input_ids": [2, length]})
    return guard


def test_a_planned_graph_past_the_recompile_limit_is_reported(limit_of_one):
    reports: list[str] = []
    guard = _planned_run("warn", reports)
    assert guard.distinct_graphs == 1 and guard.unexpected == []
    assert [event["key"] for event in guard.uncompiled] == [["train", 16]]
    assert len(reports) == 1 and "planned graph never compiled at step 1" in reports[0]


def test_fail_mode_stops_at_the_uncompiled_graph(limit_of_one):
    with pytest.raises(RecompilationError, match="never compiled"):
        _planned_run("fail", [])


def test_every_planned_graph_compiled_reports_nothing():
    torch._dynamo.reset()
    reports: list[str] = []
    guard = _planned_run("warn", reports)
    torch._dynamo.reset()
    assert guard.uncompiled == [] and reports == [] and guard.distinct_graphs == 2
