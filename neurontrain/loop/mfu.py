"""Model FLOPs utilisation: the training FLOPs a run's real tokens cost by the planner's count (6 x parameters a
token, plus attention at 12 x layers x hidden a token per attended position: `data/buckets.py`), over the peak
FLOP/s of the devices that trained them. Pure logic: which device a run is on is found in `run_facts.py`.

The peak is the device's dense BF16 figure (the convention of TorchTitan and optimum-neuron, whatever the run's
precision): per worker, one NeuronCore (trn1) or one logical NeuronCore (trn2, trn3: NEURON_LOGICAL_NC_CONFIG
physical cores, 2 by default), or one CUDA device. A CPU has no peak worth comparing with: MFU is null there, and
wherever the device's peak is not known, with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from neurontrain.data.buckets import training_flops_per_token

TERA = 1e12
# Dense BF16 TFLOPS of one physical NeuronCore (the Neuron architecture pages: trn1 chip 190 over 2 NeuronCore-v2,
# trn2 chip 667 over 8 NeuronCore-v3, trn3 chip 671 over 8 NeuronCore-v4).
NEURON_CORE_BF16_TFLOPS = {"trn1": 95.0, "trn2": 667.0 / 8, "trn3": 671.0 / 8}
DEFAULT_LOGICAL_CORES = {"trn1": 1, "trn2": 2, "trn3": 2}  # physical cores a worker drives by default
# Dense BF16 tensor-core TFLOPS of CUDA cards by name (NVIDIA's data sheets), matched in this order: every word of
# a rule must be a word of torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3" is the SXM card).
CUDA_BF16_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("GH200",), 989.4),
    (("H200",), 989.4),
    (("H100", "PCIE"), 756.0),
    (("H100", "NVL"), 835.0),
    (("H100",), 989.4),
    (("B200",), 2250.0),
    (("A100",), 312.0),
    (("L40S",), 362.0),
    (("L4",), 121.0),
)


@dataclass(frozen=True)
class DevicePeak:
    """One worker's device and its dense BF16 peak in FLOP/s (None where it has none or it is not known, with why)."""

    device: str
    flops: float | None
    reason: str | None = None


def neuron_peak(family: str | None, logical_cores: int | None = None) -> DevicePeak:
    """A Neuron worker's peak: `family` trn1/trn2/trn3 (None: not known), `logical_cores` physical NeuronCores a
    worker drives (NEURON_LOGICAL_NC_CONFIG; None: the family's default)."""
    if family not in NEURON_CORE_BF16_TFLOPS:
        known = ", ".join(NEURON_CORE_BF16_TFLOPS)
        return DevicePeak(f"neuron {family or 'unknown'}", None, f"Neuron instance family not known ({known})")
    cores = logical_cores or DEFAULT_LOGICAL_CORES[family]
    per_core = NEURON_CORE_BF16_TFLOPS[family]
    return DevicePeak(f"{family} NeuronCore x {cores}", per_core * cores * TERA)


def cuda_peak(name: str | None) -> DevicePeak:
    """A CUDA device's peak from its name."""
    if not name:
        return DevicePeak("cuda", None, "CUDA device name not known")
    words = name.upper().replace("-", " ").split()
    for rule, tflops in CUDA_BF16_TFLOPS:
        if all(word in words for word in rule):
            return DevicePeak(name, tflops * TERA)
    return DevicePeak(name, None, f"no BF16 peak known for {name}")


def cpu_peak() -> DevicePeak:
    return DevicePeak("cpu", None, "CPU: n/a (no device peak to compare with)")


@dataclass(frozen=True)
class FlopCount:
    """Training FLOPs (forward and backward) of one token: `dense` plus `attention` per position it attends."""

    dense: float
    attention: float

    @classmethod
    def of_model(cls, n_params: int, n_layers: int, hidden: int) -> FlopCount:
        return cls(*training_flops_per_token(n_params, n_layers, hidden))

    def per_token(self, length: int) -> float:
        """A token of a row (bucket) of `length` tokens: the row's whole attention, as the step computes it."""
        return self.dense + self.attention * length

    def of_tokens(self, real_tokens_by_length: Mapping[int, int]) -> float:
        """FLOPs of real (non-padding) tokens trained in rows of each length."""
        return sum(real * self.per_token(length) for length, real in real_tokens_by_length.items())


@dataclass(frozen=True)
class Utilisation:
    """MFU of a span of training: FLOPs trained over seconds, against `devices` x the per-device peak."""

    peak: DevicePeak
    devices: int

    def mfu(self, flops: float, seconds: float) -> float | None:
        if self.peak.flops is None or seconds <= 0:
            return None
        return flops / seconds / (self.peak.flops * self.devices)

    def describe(self, flops: float) -> dict:
        """summary.json's `mfu_basis`: what the figure divides (or why there is none)."""
        out: dict = {"device": self.peak.device, "devices": self.devices, "model_flops": flops}
        if self.peak.flops is None:
            return out | {"reason": self.peak.reason}
        return out | {"peak_flops_per_device": self.peak.flops, "peak": "dense bf16"}


def mfu_of(basis: Mapping | None, seconds: float) -> float | None:
    """The MFU an `mfu_basis` (as `Utilisation.describe` wrote it) gives over `seconds`; None without a peak."""
    if not basis or basis.get("peak_flops_per_device") is None or seconds <= 0:
        return None
    return basis["model_flops"] / seconds / (basis["peak_flops_per_device"] * basis["devices"])
