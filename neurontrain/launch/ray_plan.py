"""What `run --launcher ray --dry-run` shows: groups and labels, the CPUs the streams need, the host CPUs a
NeuronCore gets, and that every worker's stream has the plan's bucket at every step. Pure logic."""

from __future__ import annotations

import itertools

from neurontrain.data.service import LABEL_KEY, data_cpus_needed
from neurontrain.launch.instances import INSTANCES
from neurontrain.plan.planning import RunPlan


def lockstep(plan: RunPlan) -> dict:
    """Each worker's stream lengths over the run, compared position by position (every stream is cut from the
    one global batch order, so they agree by construction; this checks the construction)."""
    batches = plan.recipe.train.max_steps * plan.recipe.train.grad_accum
    streams = [
        [b.length for b in itertools.islice(plan.collation(rank).batcher.iterate(0), batches)]
        for rank in range(plan.world)
    ]
    differing = sum(1 for lengths in zip(*streams, strict=True) if len(set(lengths)) > 1)
    return {"holds": differing == 0, "micro_batches": batches, "positions_with_differing_buckets": differing}


def describe_service(plan: RunPlan, local_sizes: dict[str, int] | None) -> dict:
    spec = plan.recipe.data.service
    groups = []
    for group in plan.recipe.cluster.groups:
        entry = {"name": group.name, "role": group.role, "instance_type": group.instance_type, "count": group.count}
        trainium = INSTANCES.get((group.instance_type or "").removeprefix("ml."))
        if group.role == "trainium" and trainium is not None and trainium.vcpus:
            entry["cpus_per_neuron_core"] = trainium.vcpus / trainium.workers
        groups.append(entry)
    out = {
        "data_service": spec.kind,
        "labels": {
            "data": f"{LABEL_KEY}={spec.data_label}",
            "trainium": f"{LABEL_KEY}={spec.train_label}",
        },
        "workers": plan.world,
        "groups": groups,
        "lockstep": lockstep(plan),
    }
    if spec.kind == "ray":
        out["data_cpus_needed"] = data_cpus_needed(plan.world, spec.concurrency)
        out["prefetch_batches"] = spec.prefetch_batches
    if local_sizes is not None:
        out["local_cluster"] = local_sizes
    return out
