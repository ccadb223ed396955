"""Trainium instance types: how many workers a node runs, how NeuronCores are grouped, whether it has EFA.
Pure data and lookups, shared by `submit slurm` (EC2 names) and `submit sagemaker` (the same names with `ml.`).

Sources: the Neuron documentation (trn1: 16 Trainium devices x 2 NeuronCores; trn2: 16 devices x 8 physical
NeuronCore-v3, grouped two by two by the default logical NeuronCore configuration (LNC 2, runtime variable
NEURON_LOGICAL_NC_CONFIG), so 64 workers a node) and SageMaker's TrainingInstanceType list (botocore's service
model; a test checks every `ml.` name here against it).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from neurontrain.errors import UsageError


@dataclass(frozen=True)
class Trainium:
    name: str  # EC2 instance type
    workers: int  # torchrun workers a node: one per logical NeuronCore
    efa: bool  # EFA network interfaces (multi-node collectives)
    logical_nc_config: int | None = None  # NEURON_LOGICAL_NC_CONFIG to export (trn2: 2 physical cores per worker)
    vcpus: int = 0  # the host's vCPUs (EC2's instance type table)

    @property
    def sagemaker_name(self) -> str:
        return f"ml.{self.name}"

    def environment(self, nodes: int) -> dict[str, str]:
        """Neuron runtime and EFA variables for a job of `nodes` instances (AWS's multi-node scripts: EFA as the
        libfabric provider with device RDMA, fork safety for data loader workers)."""
        env: dict[str, str] = {}
        if self.efa and nodes > 1:
            env.update({"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"})
        if self.logical_nc_config is not None:
            env["NEURON_LOGICAL_NC_CONFIG"] = str(self.logical_nc_config)
        return env


INSTANCES = {
    t.name: t
    for t in (
        Trainium("trn1.2xlarge", 2, efa=False, vcpus=8),
        Trainium("trn1.32xlarge", 32, efa=True, vcpus=128),
        Trainium("trn1n.32xlarge", 32, efa=True, vcpus=128),
        Trainium("trn2.48xlarge", 64, efa=True, logical_nc_config=2, vcpus=192),
    )
}
# `submit slurm --instance-type trn1|trn1n|trn2`: the family's multi-node size
FAMILIES = {"trn1": "trn1.32xlarge", "trn1n": "trn1n.32xlarge", "trn2": "trn2.48xlarge"}


def _unknown(given: str, flag: str, known: list[str]) -> UsageError:
    close = difflib.get_close_matches(given, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return UsageError(f"{flag} {given!r} is not a Trainium instance type{hint}; known: {', '.join(known)}")


def ec2_instance(name: str, flag: str = "--instance-type") -> Trainium:
    """trn1 / trn1n / trn2 or a full EC2 name such as trn1.32xlarge."""
    key = FAMILIES.get(name, name)
    if key not in INSTANCES:
        raise _unknown(name, flag, [*FAMILIES, *INSTANCES])
    return INSTANCES[key]


def sagemaker_instance(name: str, flag: str = "--instance-type") -> Trainium:
    """A SageMaker training instance type: ml.trn1.32xlarge and the other Trainium types."""
    known = [t.sagemaker_name for t in INSTANCES.values()]
    if name not in known:
        if name.startswith("ml.") and not name.startswith("ml.trn"):
            raise UsageError(
                f"{flag} {name!r} is not a Trainium instance: the Neuron training image runs on {', '.join(known)}"
            )
        raise _unknown(name, flag, known)
    return INSTANCES[name[len("ml.") :]]
