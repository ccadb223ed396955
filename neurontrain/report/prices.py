"""On-demand prices of the instances a run may train on, for `compare`'s cost per million real tokens.

Each price has its source and the date it was read. Prices change: check them before relying on a figure, and
give another with `compare --price TYPE=USD_PER_HOUR`. `devices` is the accelerators (NeuronCores for Trainium,
GPUs) of one instance: a run of `world_size` workers is charged for ceil(world_size / devices) instances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Price:
    usd_per_hour: float  # on-demand, Linux, us-east-1
    devices: int  # workers one instance holds (NeuronCores / GPUs)
    source: str
    date: str  # when the price was read from the source


_USAGE_AI = "usage.ai/blogs/aws/ai-ml-cost/trainium-vs-gpu-instances (updated 2026-06-25), quoting AWS on-demand"
_AWS_TRN1 = "aws.amazon.com/ec2/instance-types/trn1 (on-demand column; not re-read from the build machine)"

PRICES: dict[str, Price] = {
    "trn1.2xlarge": Price(1.34375, 2, _AWS_TRN1, "unverified"),
    "trn1.32xlarge": Price(21.50, 32, _USAGE_AI, "2026-11-27"),
    "trn1n.32xlarge": Price(24.78, 32, _AWS_TRN1, "unverified"),
    "p4d.24xlarge": Price(32.77, 8, _USAGE_AI, "2026-11-27"),
}


def instances_for(instance_type: str, world_size: int, prices: dict[str, Price] = PRICES) -> int:
    return max(1, math.ceil(world_size / prices[instance_type].devices))


def cost_per_million_tokens(
    instance_type: str, world_size: int, tokens_per_second: float, prices: dict[str, Price] = PRICES
) -> float | None:
    """USD per million real (non-padding) training tokens at the run's throughput; None without throughput."""
    if tokens_per_second <= 0:
        return None
    hourly = prices[instance_type].usd_per_hour * instances_for(instance_type, world_size, prices)
    return hourly / (tokens_per_second * 3600.0) * 1e6
