"""SageMaker heterogeneous clusters: a CPU instance group that makes batches and the Trainium group that trains.
Pure logic: the request's instance groups and channel groups, and each host's role read back from the
container's resourceconfig.json.

`submit sagemaker --data-instances TYPE:N` turns the recipe's data service on (data.service.kind ray) and names
the two groups in cluster.groups (the recipe's own names where it has them). The data channel goes to the data
group only; every host runs the entry script once (no distribution flag: the entry is each host's launcher).
Inside the job the first data host is the Ray head, where the run's driver starts; every other host joins it
with its role as node label.
"""

from __future__ import annotations

import re

from neurontrain.errors import UsageError
from neurontrain.launch.ray_hosts import HostRole

DEFAULT_NAMES = {"data": "data", "trainium": "trainium"}
HOMOGENEOUS = "homogeneousCluster"  # the group name SageMaker gives a job without instance groups


def parse_data_instances(spec: str) -> tuple[str, int]:
    """--data-instances ml.c5.18xlarge:2 -> ("ml.c5.18xlarge", 2)."""
    kind, sep, count = spec.rpartition(":")
    if not sep or not re.fullmatch(r"ml\.[a-z0-9]+\.[a-z0-9]+", kind) or not count.isdigit() or int(count) < 1:
        raise UsageError(f"--data-instances {spec!r}: expected TYPE:N with a SageMaker type, e.g. ml.c5.18xlarge:2")
    if kind.startswith("ml.trn"):
        raise UsageError(f"--data-instances {kind}: the data group is of CPU instances (--instance-type: Trainium)")
    return kind, int(count)


def with_groups(recipe: dict, data: tuple[str, int], trainium: tuple[str, int]) -> dict:
    """The recipe with the data service on and cluster.groups naming both groups (the recipe's names kept)."""
    names = dict(DEFAULT_NAMES)
    for group in (recipe.get("cluster") or {}).get("groups") or []:
        names[group["role"]] = group["name"]
    groups = [
        {"name": names[role], "role": role, "instance_type": kind, "count": count}
        for role, (kind, count) in (("data", data), ("trainium", trainium))
    ]
    service = {**(recipe.get("data") or {}).get("service", {}), "kind": "ray"}
    return {**recipe, "data": {**recipe["data"], "service": service}, "cluster": {"groups": groups}}


def group_name(recipe: dict, role: str) -> str:
    for group in (recipe.get("cluster") or {}).get("groups") or []:
        if group["role"] == role:
            return group["name"]
    raise UsageError(f"cluster.groups has no {role} group")


def instance_groups(recipe: dict) -> list[dict]:
    """ResourceConfig.InstanceGroups from cluster.groups."""
    return [
        {"InstanceGroupName": g["name"], "InstanceType": g["instance_type"], "InstanceCount": g["count"]}
        for g in recipe["cluster"]["groups"]
    ]


def host_role(resource_config: dict, groups: list[dict]) -> HostRole | None:
    """This host's role from resourceconfig.json (SageMaker writes current_group_name, local mode
    current_instance_group); None for a homogeneous job."""
    current = resource_config.get("current_group_name") or resource_config.get("current_instance_group")
    listed = resource_config.get("instance_groups") or []
    if current in (None, HOMOGENEOUS) or len(listed) < 2:
        return None
    roles = {g["name"]: g["role"] for g in groups}
    hosts: dict[str, list[str]] = {"data": [], "trainium": []}
    for group in listed:
        name = group.get("instance_group_name")
        if name not in roles:
            raise UsageError(f"instance group {name!r} of this job has no role in cluster.groups ({sorted(roles)})")
        hosts[roles[name]] += list(group.get("hosts") or [])
    if current not in roles:
        raise UsageError(f"this host's instance group {current!r} has no role in cluster.groups ({sorted(roles)})")
    if not hosts["data"] or not hosts["trainium"]:
        raise UsageError("a heterogeneous job needs hosts in both a data group and a trainium group")
    host = resource_config.get("current_host", "")
    if host not in hosts[roles[current]]:
        raise UsageError(f"current_host {host!r} is not a host of its group {current!r}")
    return HostRole(host, roles[current], hosts["data"][0], tuple(hosts["data"]), tuple(hosts["trainium"]))
