"""The Ray cluster a `--launcher ray` run uses: joined (data.service.address or RAY_ADDRESS), or a loopback
cluster started here (`--local-cluster data=N,trainium=M`), checked before anything is scheduled on it.

Nodes say their role with the label `neurontrain-role` (the recipe's data.service.data_label and
train_label). A data node needs CPUs for every worker's stream at once (`data_cpus_needed`); too few would
leave the streams waiting on each other forever, so it is refused up front.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from neurontrain.data.ray_service import import_ray
from neurontrain.data.service import LABEL_KEY, data_cpus_needed
from neurontrain.errors import UsageError
from neurontrain.logs import get_logger
from neurontrain.recipe import DataServiceSpec

log = get_logger(__name__)


@dataclass
class RoleNodes:
    """Alive nodes by role: their count and CPUs (and NeuronCores, where Ray found any)."""

    nodes: int = 0
    cpus: float = 0.0
    neuron_cores: float = 0.0


def role_nodes(nodes: list[dict], label: str) -> RoleNodes:
    out = RoleNodes()
    for node in nodes:
        if node.get("Alive") and node.get("Labels", {}).get(LABEL_KEY) == label:
            out.nodes += 1
            out.cpus += node.get("Resources", {}).get("CPU", 0.0)
            out.neuron_cores += node.get("Resources", {}).get("neuron_cores", 0.0)
    return out


def check_roles(nodes: list[dict], spec: DataServiceSpec, world: int, worker_resource: str, served: bool) -> dict:
    """The cluster's data and trainium nodes, refused (exit 2) where the run cannot be placed on them."""
    data, train = role_nodes(nodes, spec.data_label), role_nodes(nodes, spec.train_label)
    if train.nodes == 0:
        raise UsageError(f"the Ray cluster has no node labelled {LABEL_KEY}={spec.train_label} for the workers")
    have = train.neuron_cores if worker_resource == "neuron_cores" else train.cpus
    if have < world:
        raise UsageError(
            f"{world} workers need {world} {worker_resource} on {LABEL_KEY}={spec.train_label} nodes; "
            f"the cluster has {have:g}"
        )
    if served:
        needed = data_cpus_needed(world, spec.concurrency)
        if data.nodes == 0:
            raise UsageError(f"the Ray cluster has no node labelled {LABEL_KEY}={spec.data_label} to make batches")
        if data.cpus < needed:
            raise UsageError(
                f"{world} workers' streams with data.service.concurrency {spec.concurrency} need {needed} CPUs on "
                f"{LABEL_KEY}={spec.data_label} nodes at once; the cluster has {data.cpus:g}"
            )
    return {
        "data_nodes": data.nodes,
        "data_cpus": data.cpus,
        "trainium_nodes": train.nodes,
        "trainium_cpus": train.cpus,
        "neuron_cores": train.neuron_cores,
    }


def count_placement(ran: list[tuple[str, str, str | None]], nodes: list[dict]) -> dict[str, dict[str, int]]:
    """(kind, name, node id) of every task and actor -> {node role: {"kind name": count}}."""
    role_of = {node["NodeID"]: node.get("Labels", {}).get(LABEL_KEY, "unlabelled") for node in nodes}
    out: dict[str, dict[str, int]] = {}
    for kind, name, node_id in ran:
        if node_id is None:  # an actor's creation task has no node of its own; the actor is counted
            continue
        counts = out.setdefault(role_of.get(node_id, "unknown"), {})
        counts[f"{kind} {name}"] = counts.get(f"{kind} {name}", 0) + 1
    return out


def placement(nodes: list[dict]) -> dict[str, dict[str, int]]:
    """Every task and actor the cluster has run, by node role and name (Ray's state API, ray[default])."""
    from ray.util.state import list_actors, list_tasks  # lazy: with ray

    ran: list[tuple[str, str, str | None]] = [("actor", a.class_name, a.node_id) for a in list_actors(limit=10_000)]
    ran += [("task", t.name, t.node_id) for t in list_tasks(limit=10_000)]
    return count_placement(ran, nodes)


class RayCluster:
    """This process's connection to a Ray cluster, and the loopback cluster it started, if any."""

    def __init__(self, address: str, local: Any | None) -> None:
        self.address, self.local = address, local

    def close(self) -> None:
        ray = import_ray()
        ray.shutdown()
        if self.local is not None:
            self.local.shutdown()


def join_cluster(spec: DataServiceSpec, local_sizes: dict[str, int] | None, world: int) -> RayCluster:
    """Join the recipe's or RAY_ADDRESS's cluster, or start a loopback one sized for `world` workers."""
    ray = import_ray()
    local = None
    if local_sizes is not None:
        local = _start_local(spec, local_sizes, world)
        address = local.address
    else:
        address = spec.address or os.environ.get("RAY_ADDRESS")
        if not address:
            raise UsageError(
                "--launcher ray needs a cluster: data.service.address, RAY_ADDRESS, or "
                "--local-cluster data=1,trainium=1"
            )
    try:
        ray.init(address=address, logging_level="WARNING", configure_logging=True)
    except Exception as exc:  # ConnectionError and Ray's own errors: one line for the user
        if local is not None:
            local.shutdown()
        raise UsageError(f"cannot join the Ray cluster at {address}: {str(exc).splitlines()[0]}") from None
    return RayCluster(address, local)


def _start_local(spec: DataServiceSpec, sizes: dict[str, int], world: int) -> Any:
    """Nodes of one machine: the head is the first data node (the driver's node, as on a real cluster)."""
    from ray.cluster_utils import Cluster  # lazy: with ray

    data_cpus = math.ceil((data_cpus_needed(world, spec.concurrency) + 1) / sizes["data"])
    train_cpus = math.ceil(world / sizes["trainium"])
    log.info(
        f"starting a loopback Ray cluster: {sizes['data']} data node(s) of {data_cpus} CPUs, "
        f"{sizes['trainium']} trainium node(s) of {train_cpus} CPUs (logical CPUs on this machine)"
    )
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": data_cpus, "labels": {LABEL_KEY: spec.data_label}},
    )
    for _ in range(sizes["data"] - 1):
        cluster.add_node(num_cpus=data_cpus, labels={LABEL_KEY: spec.data_label})
    for _ in range(sizes["trainium"]):
        cluster.add_node(num_cpus=train_cpus, labels={LABEL_KEY: spec.train_label})
    cluster.wait_for_nodes()
    return cluster
