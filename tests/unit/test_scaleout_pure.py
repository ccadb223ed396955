"""Scale-out logic without workers: topology -> torchrun flags, global batch arithmetic, per-worker rows and
the data-parallel plan (the sbatch script and the SageMaker request: test_submit_pure.py)."""

import pytest
from conftest import RECIPES

from neurontrain.data.batching import IndexBatch
from neurontrain.data.collate import Collator
from neurontrain.data.sharding import resolve_grad_accum, worker_rows
from neurontrain.errors import UsageError
from neurontrain.launch.elastic import root_failure
from neurontrain.launch.topology import Topology, torchrun_args
from neurontrain.plan.description import describe_plan


def test_torchrun_args_single_node_is_standalone():
    args = torchrun_args(Topology(nproc_per_node=2, max_restarts=1))
    assert args == ["--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1"]


def test_torchrun_args_multi_node_static_and_c10d():
    static = torchrun_args(
        Topology(nproc_per_node=4, nnodes=2, node_rank=1, master_addr="10.0.0.5", master_port=29400, rdzv_timeout=60)
    )
    assert "--rdzv-backend=static" in static and "--node-rank=1" in static and "--master-addr=10.0.0.5" in static
    assert "--master-port=29400" in static and "--rdzv-conf=timeout=60" in static and "--nnodes=2" in static
    c10d = torchrun_args(
        Topology(nproc_per_node=32, nnodes=4, rdzv_endpoint="head:29500", rdzv_id="77", max_restarts=2)
    )
    assert "--rdzv-backend=c10d" in c10d and "--rdzv-endpoint=head:29500" in c10d and "--rdzv-id=77" in c10d
    # torchrun's own parser accepts what we build
    from torch.distributed import run as torchrun

    parsed = torchrun.parse_args(c10d + ["--module", "neurontrain", "run", "r.yaml"])
    assert parsed.nproc_per_node == "32" and parsed.max_restarts == 2 and parsed.training_script == "neurontrain"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"nproc_per_node": 0}, "--nproc-per-node"),
        ({"nnodes": 2, "node_rank": 2}, "--node-rank"),
        ({"max_restarts": -1}, "--max-restarts"),
        ({"master_port": 70000}, "--master-port"),
        ({"master_addr": "a b"}, "--master-addr"),
        ({"nnodes": 2, "rdzv_endpoint": "head"}, "HOST:PORT"),
        ({"nnodes": 2, "rdzv_endpoint": "head:1"}, "--rdzv-id"),
    ],
)
def test_bad_topologies(fields, message):
    with pytest.raises(UsageError, match=message):
        Topology(**fields)


def test_global_batch_arithmetic():
    assert resolve_grad_accum(8, 2, 1, None) == 1
    assert resolve_grad_accum(8, 2, 1, 64) == 4
    assert resolve_grad_accum(8, 2, 4, 64) == 4
    with pytest.raises(UsageError, match="not divisible by data.batch_size 8 x 2 workers = 16"):
        resolve_grad_accum(8, 2, 1, 24)
    with pytest.raises(UsageError, match="contradicts"):
        resolve_grad_accum(8, 2, 2, 64)


def test_worker_rows_partition_every_batch():
    indices = tuple(range(11))
    parts = [worker_rows(indices, r, 3) for r in range(3)]
    assert sorted(sum(parts, ())) == list(indices) and [len(p) for p in parts] == [4, 4, 3]


def test_collator_takes_its_rows_and_counts_loss_items():
    ids = [[5, 6, 7], [5, 6], [5, 6, 7, 8], [5]]
    batch = IndexBatch(4, (0, 1, 2, 3))
    r0 = Collator(ids, None, "causal-lm", 2, 0, rank=0, world=2)(batch)
    r1 = Collator(ids, None, "causal-lm", 2, 0, rank=1, world=2)(batch)
    assert r0["input_ids"].tolist() == [[5, 6, 7, 0], [5, 6, 7, 8]]
    assert r1["input_ids"].tolist() == [[5, 6, 0, 0], [5, 0, 0, 0]]
    assert (r0["loss_items"], r1["loss_items"]) == (2 + 3, 1 + 0)  # next-token labels per row: length - 1
    assert r0["real_tokens"] + r1["real_tokens"] == 10
    cls = Collator(ids, [1, 0, 1, 0], "sequence-classification", 2, 0, rank=1, world=2)(IndexBatch(4, (0, 1, 2)))
    assert cls["labels"].tolist() == [0, -100] and cls["loss_items"] == 1


def _plan(world: int, *overrides: str):
    from neurontrain.plan.planning import make_plan
    from neurontrain.recipe import load_recipe

    recipe = load_recipe(RECIPES / "tiny-llama-clm.yaml", ["data.buckets=[64,128]", "data.packing=off", *overrides])
    return make_plan(recipe, "xla-cpu", world=world)


def test_data_parallel_plan_uses_global_batches_and_splits_the_step():
    one, two = _plan(1, "data.batch_size=16"), _plan(2, "data.batch_size=8")
    assert two.batcher.batch_size == 16 and one.batcher.batch_size == 16
    assert [b.indices for b in one.batcher.epoch(0)] == [b.indices for b in two.batcher.epoch(0)]
    assert ("train", 64) in one.expected_graphs() and ("optimizer",) not in one.expected_graphs()
    assert ("train-micro", 64) in two.expected_graphs() and ("optimizer",) in two.expected_graphs()
    described = describe_plan(two)
    assert (described["world_size"], described["per_worker_batch"], described["effective_batch"]) == (2, 8, 16)
    accum = describe_plan(_plan(2, "train.global_batch_size=64"))
    assert (accum["grad_accum"], accum["effective_batch"]) == (4, 64)
    from neurontrain.compile.discover import run_plan_id

    assert run_plan_id(two, "xla-cpu") != run_plan_id(_plan(1, "data.batch_size=8"), "xla-cpu")
    # the fingerprint leaves out what resume may change, but those settings change the graphs a manifest lists
    by_setting = {
        run_plan_id(_plan(2, "data.batch_size=8", *settings), "xla-cpu")
        for settings in [
            ("train.zero1=false", "train.activation_checkpointing=none"),
            ("train.zero1=true", "train.activation_checkpointing=none"),
            ("train.zero1=false", "train.activation_checkpointing=every_2"),
            ("train.zero1=false", "train.activation_checkpointing=full"),
        ]
    }
    assert len(by_setting) == 4


def test_too_many_workers_for_the_data():
    with pytest.raises(UsageError, match="make no global batch of 8 x 4 workers = 32"):
        _plan(4, "data.train_samples=20")
    with pytest.raises(UsageError, match="4 workers but only 3 training samples"):
        _plan(4, "data.train_samples=3", "data.last_batch=pad")


@pytest.mark.parametrize("buckets", ["data.buckets=[32,64]", "data.packing=auto"])
def test_a_worker_planning_from_the_served_lengths_plans_what_the_launcher_planned(buckets):
    """The launcher plans from the data; a served worker (data.service) plans again from the lengths alone. Both
    plans agree, down to the plan id that names the compile cache and the manifest: fixed buckets shorter than
    data.max_length cut the same samples on either side."""
    from neurontrain.compile.discover import run_plan_id
    from neurontrain.data.sources import prepare_data
    from neurontrain.plan.planning import make_plan
    from neurontrain.recipe import load_recipe

    recipe = load_recipe(RECIPES / "tiny-llama-clm.yaml", [buckets])
    data = prepare_data(recipe)
    lengths = prepare_data(recipe).without_train_ids()  # a worker's own copy: planning cuts what it holds
    launcher, worker = (
        make_plan(recipe, "xla-cpu", data=data, world=2),
        make_plan(recipe, "xla-cpu", data=lengths, world=2),
    )
    assert describe_plan(worker) == describe_plan(launcher)
    assert run_plan_id(worker, "xla-cpu") == run_plan_id(launcher, "xla-cpu")
    assert worker.batcher.lengths == launcher.batcher.lengths and lengths.truncated == data.truncated
    if buckets == "data.buckets=[32,64]":
        assert data.truncated > 0 and max(launcher.batcher.lengths) == 64  # the case where planning cuts samples


def _failures(*cases: tuple[int, int, float]) -> dict:
    """torchrun's own failure records (ProcessFailure): (rank, exit code, timestamp)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {}
    for rank, code, timestamp in cases:
        failures[rank] = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="/nonexistent")
        failures[rank].timestamp = timestamp
    return failures


def test_a_workers_own_verdict_names_the_group_when_a_peer_crashed_in_the_same_second():
    # every worker of a failed preflight exits 3; one aborting in its teardown must not make the run's exit 1
    assert root_failure(_failures((0, 3, 100), (1, -6, 100)))[0] == 0
    assert root_failure(_failures((0, -6, 100), (1, 3, 101)))[0] == 1
    # otherwise the first failure names it: a crash long before the others' health check timed out on it
    assert root_failure(_failures((0, 3, 160), (1, -9, 100)))[0] == 1
    assert root_failure(_failures((0, 1, 100), (1, -6, 100)))[0] == 0
