"""The data service's pure parts and the heterogeneous-cluster logic, without a Ray cluster: batch positions,
rows in and out, the lockstep check, cluster checks, the torchrun environment, SageMaker instance groups and
host roles, the recipe keys, and `run --launcher ray`'s dry run and refusals."""

import itertools
import json

import pytest
import torch
from conftest import RECIPES, cli_in_process

from neurontrain.data.batching import Batcher, IndexBatch
from neurontrain.data.collate import Collator
from neurontrain.data.rows import decode_row, encode_row
from neurontrain.data.service import BatchIndex, LockstepError, StreamRecord, in_lockstep, local_cluster_sizes
from neurontrain.errors import UsageError
from neurontrain.launch.ray_cluster import check_roles, count_placement
from neurontrain.launch.ray_train import torchrun_environment
from neurontrain.launch.sagemaker_groups import host_role, parse_data_instances, with_groups
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import DataServiceSpec, load_recipe

LLAMA = str(RECIPES / "tiny-llama-clm.yaml")
LENGTHS = tuple(5 + (i * 7) % 40 for i in range(50))


def test_batch_index_gives_the_batch_order_at_any_position_across_epochs():
    batcher = Batcher(LENGTHS, 4, (16, 32, 48), shuffle=True, seed=3, drop_last=True, multiple=8)
    index = BatchIndex(batcher)
    expected = list(itertools.islice(batcher.iterate(0), 40))  # 12 a epoch: three epochs and more
    assert [index.at(p) for p in range(40)] == expected
    assert index.at(7) == expected[7] and index.at(30) == expected[30]  # going back re-reads the epoch


@pytest.mark.parametrize("packed", [False, True])
def test_rows_round_trip_to_the_collators_batch(packed):
    ids = [list(range(1, n + 1)) for n in LENGTHS]
    collate = Collator(ids, None, "causal-lm", 2, 0, rank=1, world=2)
    batch = IndexBatch(16, (0, 1, 2, 3)) if not packed else IndexBatch(48, (0, 1, 2, 3), ((0, 1), (2,), (3,), ()))
    made = collate(batch)
    position, node, back = decode_row(encode_row(11, collate(batch), "data@abc"))
    assert (position, node) == (11, "data@abc")
    assert back.keys() == made.keys()
    for key, value in made.items():
        assert torch.equal(back[key], value) if isinstance(value, torch.Tensor) else back[key] == value
    back["input_ids"][0, 0] = 7  # writable: a copy of Ray's read-only array


def _rows(lengths: list[int], start: int = 0):
    for p, n in enumerate(lengths, start=start):
        yield p, "data@n1", {"input_ids": torch.zeros(2, n)}


def test_lockstep_passes_the_plan_and_refuses_another_bucket_or_position():
    planned = [IndexBatch(n, ()) for n in (16, 32, 16)]
    record = StreamRecord(rank=1)
    assert len(list(in_lockstep(_rows([16, 32, 16], 4), iter(planned), 4, record))) == 3
    assert record.received == [(4, 16), (5, 32), (6, 16)] and record.produced_on == {"data@n1": 3}
    with pytest.raises(
        LockstepError, match="worker 1 received batch 1 of length 16; the plan has batch 1 of length 32"
    ):
        list(in_lockstep(_rows([16, 16]), iter(planned), 0, StreamRecord(rank=1)))
    with pytest.raises(LockstepError, match="received batch 3 of length 16; the plan has batch 2"):
        list(in_lockstep(_rows([16], 3), iter(planned), 2, StreamRecord(rank=0)))


def test_local_cluster_spec():
    assert local_cluster_sizes("data=2,trainium=1") == {"data": 2, "trainium": 1}
    for bad in ("data=1", "data=0,trainium=1", "gpu=1,trainium=1", "data=1,data=2", "data=x,trainium=1"):
        with pytest.raises(ValueError, match="--local-cluster"):
            local_cluster_sizes(bad)


def _node(role: str, cpus: float, alive: bool = True, node_id: str = "n") -> dict:
    return {"NodeID": node_id, "Alive": alive, "Labels": {"neurontrain-role": role}, "Resources": {"CPU": cpus}}


def test_cluster_checks_refuse_what_cannot_be_placed():
    spec = DataServiceSpec(kind="ray", concurrency=2)
    nodes = [_node("data", 6), _node("trainium", 2), _node("trainium", 8, alive=False)]
    assert check_roles(nodes, spec, 2, "CPU", served=True)["data_cpus"] == 6
    with pytest.raises(UsageError, match="need 3 CPU on neurontrain-role=trainium nodes; the cluster has 2"):
        check_roles(nodes, spec, 3, "CPU", served=False)
    with pytest.raises(UsageError, match="concurrency 2 need 9 CPUs on neurontrain-role=data nodes at once"):
        check_roles([_node("data", 6), _node("trainium", 3)], spec, 3, "CPU", served=True)
    with pytest.raises(UsageError, match="no node labelled neurontrain-role=data"):
        check_roles([_node("trainium", 2)], spec, 2, "CPU", served=True)
    with pytest.raises(UsageError, match="no node labelled neurontrain-role=trainium"):
        check_roles([_node("data", 8)], spec, 2, "CPU", served=True)
    with pytest.raises(UsageError, match="2 neuron_cores"):
        check_roles(nodes, spec, 2, "neuron_cores", served=True)


def test_placement_is_counted_by_node_role():
    nodes = [_node("data", 4, node_id="d"), _node("trainium", 2, node_id="t")]
    ran = [("actor", "MapWorker", "d"), ("task", "ReadRange", "d"), ("task", "ReadRange", "d"),
           ("actor", "RayTrainWorker", "t"), ("task", "MapWorker.__init__", None), ("task", "x", "gone")]  # fmt: skip
    assert count_placement(ran, nodes) == {
        "data": {"actor MapWorker": 1, "task ReadRange": 2},
        "trainium": {"actor RayTrainWorker": 1},
        "unknown": {"task x": 1},
    }


def test_ray_workers_get_torchruns_environment_and_the_root_communicator():
    context = {"rank": 3, "world": 4, "local_rank": 1, "local_world": 2, "node_rank": 1}
    env = torchrun_environment(context, ("10.0.0.5", 29400, 41000), restart=2)
    assert env == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "NEURON_RT_ROOT_COMM_ID": "10.0.0.5:41000",
    }


def test_recipe_service_and_groups_change_no_fingerprint_and_are_checked():
    plain = load_recipe(LLAMA, [])
    served = load_recipe(LLAMA, ["data.service.kind=ray", "data.service.concurrency=3"])
    grouped = with_groups(plain.model_dump(mode="json"), ("ml.c5.xlarge", 2), ("ml.trn1.32xlarge", 4))
    assert plain.data.service.kind == "none"
    assert plain.fingerprint() == served.fingerprint() == type(plain).model_validate(grouped).fingerprint()
    with pytest.raises(UsageError, match="cluster.groups: a heterogeneous cluster needs a data group"):
        load_recipe(LLAMA, ['cluster.groups=[{"name": "a", "role": "data"}]'])
    with pytest.raises(UsageError, match="data.service.kind"):
        load_recipe(LLAMA, ["data.service.kind=spark"])


def test_a_plan_from_lengths_only_is_the_plan_from_the_ids():
    recipe = load_recipe(LLAMA, ["data.buckets=[32,64,128]"])
    full = make_plan(recipe, "xla-cpu", world=2)
    lengths = make_plan(recipe, "xla-cpu", world=2, data=full.data.without_train_ids())
    assert lengths.batcher == full.batcher and lengths.expected_graphs() == full.expected_graphs()
    assert lengths.collation(1) == full.collation(1)
    with pytest.raises(ValueError, match="training lengths only"):
        lengths.collator("train", 0)


def test_data_instances_groups_keep_the_recipes_names():
    assert parse_data_instances("ml.c5.18xlarge:2") == ("ml.c5.18xlarge", 2)
    for bad in ("ml.c5.18xlarge", "c5.18xlarge:2", "ml.c5.18xlarge:0", "ml.trn1.2xlarge:1"):
        with pytest.raises(UsageError, match="--data-instances"):
            parse_data_instances(bad)
    recipe = load_recipe(
        LLAMA, ['cluster.groups=[{"name": "cpu", "role": "data"}, {"name": "trn", "role": "trainium"}]']
    ).model_dump(mode="json")
    shipped = with_groups(recipe, ("ml.c5.xlarge", 2), ("ml.trn1.32xlarge", 1))
    assert [(g["name"], g["instance_type"], g["count"]) for g in shipped["cluster"]["groups"]] == [
        ("cpu", "ml.c5.xlarge", 2),
        ("trn", "ml.trn1.32xlarge", 1),
    ]
    assert shipped["data"]["service"]["kind"] == "ray"


GROUPS = [{"name": "cpu", "role": "data"}, {"name": "trn", "role": "trainium"}]


def _resource_config(current: str, group: str, key: str = "current_group_name") -> dict:
    listed = [
        {"instance_group_name": "cpu", "instance_type": "ml.c5.xlarge", "hosts": ["algo-2", "algo-3"]},
        {"instance_group_name": "trn", "instance_type": "ml.trn1.32xlarge", "hosts": ["algo-1"]},
    ]
    return {"current_host": current, key: group, "hosts": ["algo-1", "algo-2", "algo-3"], "instance_groups": listed}


@pytest.mark.parametrize("key", ["current_group_name", "current_instance_group"])
def test_host_roles_from_either_spelling_of_the_resource_config(key):
    head = host_role(_resource_config("algo-2", "cpu", key), GROUPS)
    other = host_role(_resource_config("algo-3", "cpu", key), GROUPS)
    trainium = host_role(_resource_config("algo-1", "trn", key), GROUPS)
    assert head.is_head and head.role == "data" and head.head == "algo-2"
    assert not other.is_head and other.role == "data" and other.head == "algo-2"
    assert not trainium.is_head and trainium.role == "trainium" and trainium.trainium_hosts == ("algo-1",)
    assert head.hosts == ("algo-2", "algo-3", "algo-1")


def test_a_homogeneous_resource_config_has_no_role_and_bad_ones_are_refused():
    homogeneous = {
        "current_host": "algo-1",
        "current_group_name": "homogeneousCluster",
        "instance_groups": [{"instance_group_name": "homogeneousCluster", "hosts": ["algo-1"]}],
    }
    assert host_role(homogeneous, GROUPS) is None
    assert host_role({"current_host": "algo-1", "hosts": ["algo-1"]}, GROUPS) is None
    with pytest.raises(UsageError, match="instance group 'cpu' of this job has no role"):
        host_role(_resource_config("algo-1", "trn"), [{"name": "trn", "role": "trainium"}])
    with pytest.raises(UsageError, match="current_host 'algo-9' is not a host of its group 'trn'"):
        host_role(_resource_config("algo-9", "trn"), GROUPS)


def test_dry_run_shows_groups_labels_and_that_lockstep_holds(capsys):
    code, out, err = cli_in_process(
        capsys, "run", LLAMA, "--launcher", "ray", "--nproc-per-node", "2", "--dry-run",
        "--set", "data.service.kind=ray", "--set", "data.buckets=[32,64,128]",
        "--set", 'cluster.groups=[{"name": "cpu", "role": "data", "instance_type": "ml.c5.xlarge"},'
        ' {"name": "trn", "role": "trainium", "instance_type": "ml.trn1.32xlarge", "count": 2}]',
    )  # fmt: skip
    assert code == 0, err
    ray = json.loads(out)["ray"]
    assert ray["lockstep"]["holds"] and ray["lockstep"]["positions_with_differing_buckets"] == 0
    assert ray["labels"] == {"data": "neurontrain-role=data", "trainium": "neurontrain-role=trainium"}
    assert ray["data_cpus_needed"] == 4 and ray["workers"] == 2
    assert ray["groups"][1]["cpus_per_neuron_core"] == 4.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "data.service.kind=ray"], "data.service.kind ray feeds workers that Ray starts: add --launcher ray"),
        (["--local-cluster", "data=1,trainium=1"], "--local-cluster starts a Ray cluster for --launcher ray"),
        (["--launcher", "ray", "--local-cluster", "data=1"], "--local-cluster 'data=1': name both roles"),
        (["--lightning", "train.py", "--launcher", "ray"], "--lightning starts the script through torchrun"),
    ],
)
def test_ray_options_refused_with_one_line(capsys, tmp_path, args, message):
    recipe = [] if "--lightning" in args else [LLAMA, "-o", str(tmp_path / "out")]
    code, _, err = cli_in_process(capsys, "run", *recipe, *args)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"neurontrain: error: {message}"), err
