"""What `neurontrain report` and `compare` read from summary.json besides the figures: the compile timeline,
per-bucket token counts over all workers, the memory plan, what the model and data are, where the run ran, and
what its MFU divides (the device and its peak)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.mfu import DevicePeak, FlopCount, Utilisation, cpu_peak, cuda_peak, neuron_peak
from neurontrain.loop.summary import instance_type
from neurontrain.plan.planning import RunPlan
from neurontrain.recipe import Recipe


def device_peak(backend: Any, instance: str | None) -> DevicePeak:
    """The peak of one worker's device: Neuron (XLA or TorchNeuron) by instance family (the runtime's platform
    target, else the host's product name, else `instance`), CUDA by the device's name, else the CPU's n/a."""
    device_type = getattr(backend.device, "type", "cpu") if not backend.is_xla else None
    if backend.name == "neuron" or device_type == "neuron":
        family = _neuron_family(instance)
        cores = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "")
        return neuron_peak(family, int(cores) if cores.isdigit() else None)
    if backend.name == "xla-cuda" or device_type == "cuda":
        import torch

        return cuda_peak(torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    return cpu_peak()


def _neuron_family(instance: str | None) -> str | None:
    """trn1/trn2/trn3 as the runtime targets it: NEURON_PLATFORM_TARGET_OVERRIDE, else the host's product name
    (as compile/runtime_cache.py's platform_target reads it), else the run's instance type."""
    override = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip()
    if override:
        return override
    try:
        product = Path("/sys/devices/virtual/dmi/id/product_name").read_text().strip()
    except OSError:
        product = ""
    family = (product or instance or "").split(".")[0]
    return family or None


def run_utilisation(recipe: Recipe, plan: RunPlan, backend: Any) -> tuple[FlopCount, Utilisation]:
    """The planner's FLOPs a token and the peak of every worker's device (data-parallel x tensor-parallel)."""
    dims = plan.dims
    groups = [(g.role, g.instance_type) for g in recipe.cluster.groups]
    peak = device_peak(backend, instance_type(groups))
    return FlopCount.of_model(dims.n_params, dims.n_layers, dims.hidden), Utilisation(peak, plan.world * plan.tp)


def report_fields(
    recipe: Recipe,
    plan: RunPlan,
    timeline: list[dict],
    dp: DataParallel,
    buckets: dict[int, list[int]],
    utilisation: tuple[FlopCount, Utilisation] | None = None,
) -> dict[str, Any]:
    """The summary's report fields. buckets: this worker's length -> [micro-batches, real tokens, slots]
    (summed over the workers here: a collective, every worker calls it). utilisation: the run's FLOP count and
    devices, for `mfu_basis` (the training FLOPs of every worker's real tokens)."""
    total: dict[int, list[int]] = {}
    for mine in dp.all_gather_object(buckets):
        for length, counts in mine.items():
            total[length] = [a + b for a, b in zip(total.get(length, [0, 0, 0]), counts)]
    groups = [(g.role, g.instance_type) for g in recipe.cluster.groups]
    return {
        "compiles": timeline,
        "bucket_tokens": [
            {"bucket": n, "batches": c[0], "real_tokens": c[1], "slots": c[2]} for n, c in sorted(total.items())
        ],
        "memory_plan": plan.memory.describe() if plan.memory is not None else None,
        "model_fingerprint": recipe.model_fingerprint(),
        "data_fingerprint": recipe.data_fingerprint(),
        "learning_rate": recipe.train.optimizer.lr,
        "instance_type": instance_type(groups),
        **({"mfu_basis": _mfu_basis(utilisation, total)} if utilisation is not None else {}),
    }


def _mfu_basis(utilisation: tuple[FlopCount, Utilisation], buckets: dict[int, list[int]]) -> dict:
    count, devices = utilisation
    return devices.describe(count.of_tokens({length: c[1] for length, c in buckets.items()}))
