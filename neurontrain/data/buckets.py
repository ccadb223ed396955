"""Sequence-length buckets: assignment, and `buckets: auto` chosen with a compile-vs-padding cost model.

Pure logic: no torch, no torch-xla. Passes over every sample's length are numpy (a million in milliseconds).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


def round_up(value: int, multiple: int) -> int:
    return ((value + multiple - 1) // multiple) * multiple


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """Smallest bucket that holds `length`; buckets are ascending. Raises ValueError if none does."""
    i = bisect.bisect_left(buckets, length)
    if i == len(buckets):
        raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True)
class StepCostModel:
    """Seconds for one step of `batch_size` sequences of length L, and seconds per compiled graph.

    step(L) = overhead + max(batch_size * L, saturation_tokens)
              * (flops_per_token + attention_flops_per_token_per_position * L) / flops_per_second

    saturation_tokens: below this many tokens per step the device is not kept busy, so a shorter bucket stops
    saving time (measured on XLA:CPU: tiny BERT steps at 16..64 tokens x 16 sequences all take ~0.1 s).
    """

    compile_seconds: float
    flops_per_second: float
    step_overhead_seconds: float
    flops_per_token: float
    attention_flops_per_token_per_position: float
    batch_size: int
    saturation_tokens: int = 0

    def step_seconds(self, length: int) -> float:
        flops = max(self.batch_size * length, self.saturation_tokens) * (
            self.flops_per_token + self.attention_flops_per_token_per_position * length
        )
        return self.step_overhead_seconds + flops / self.flops_per_second


def training_flops_per_token(n_params: int, n_layers: int, hidden: int) -> tuple[float, float]:
    """(dense FLOPs per token, attention FLOPs per token per position) for forward+backward."""
    return 6.0 * n_params, 12.0 * n_layers * hidden


# Defaults for the cost model, per backend (the native backend per device target: `native-<device>`): (seconds
# per compiled graph, FLOP/s, seconds per step, saturation tokens per step). XLA:CPU figures were fitted here to
# tiny-BERT step times at lengths 16..256 (batch 16: ~0.1 s flat up to 64 tokens a sequence, then ~79 us a token);
# Neuron and XLA:CUDA figures are planning estimates (Neuron graphs take minutes to compile) that a recipe can
# override under data.auto_buckets. A native graph's compile grows with the model's layers: COMPILE_PER_LAYER.
COST_DEFAULTS = {
    "xla-cpu": (5.0, 3.2e10, 0.02, 1024),
    "xla-cuda": (20.0, 5e13, 0.005, 8192),
    "neuron": (300.0, 4e13, 0.01, 4096),
    # inductor on the CPU: tiny BERT (2 layers) compiled its train graph in 23 to 58 s on 2 shared, busy cores
    "native-cpu": (8.0, 3.2e10, 0.02, 1024),
    # inductor on an H100 (torch 2.11): ~7.5-11.5 s a tiny-recipe graph (2 layers), 39.7 s for BERT-base's (12);
    # eager BERT-base trained 13,978 real tokens/s there (about 9e12 FLOP/s at 6 x parameters a token)
    "native-cuda": (3.5, 1e13, 0.01, 8192),
    # TorchNeuron (neuronx-cc behind torch.compile): no trn2 here; planned like Neuron's XLA graphs
    "native-neuron": (300.0, 4e13, 0.01, 4096),
}
COMPILE_PER_LAYER = {"native-cpu": 8.0, "native-cuda": 3.0}  # seconds a graph per transformer layer


def compile_seconds_per_graph(cost_key: str, n_layers: int) -> float:
    """The default seconds to compile one graph of an n_layers model under a cost key (a backend name, or
    `native-<device>`)."""
    base = COST_DEFAULTS.get(cost_key, COST_DEFAULTS["xla-cpu"])[0]
    return base + COMPILE_PER_LAYER.get(cost_key, 0.0) * n_layers


def default_cost_model(
    backend: str,
    *,
    n_params: int,
    n_layers: int,
    hidden: int,
    batch_size: int,
    overrides: Mapping[str, float | None] | None = None,
) -> StepCostModel:
    """`backend`'s cost model for a model of these dimensions, with the figures `overrides` sets (a recipe's
    data.auto_buckets). `backend` is a cost key: a backend name or `native-<device>`. Eager plans with XLA:CPU's
    figures: eager is the reference run for an XLA run and must plan the same buckets."""
    _, flops, overhead, saturation = COST_DEFAULTS.get(backend, COST_DEFAULTS["xla-cpu"])
    compile_s = compile_seconds_per_graph(backend, n_layers)
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    dense, attention = training_flops_per_token(n_params, n_layers, hidden)
    return StepCostModel(
        compile_seconds=given.get("compile_seconds", compile_s),
        flops_per_second=given.get("flops_per_second", flops),
        step_overhead_seconds=given.get("step_overhead_seconds", overhead),
        flops_per_token=dense,
        attention_flops_per_token_per_position=attention,
        batch_size=batch_size,
        saturation_tokens=int(given.get("saturation_tokens", saturation)),
    )


@dataclass(frozen=True)
class BucketChoice:
    buckets: list[int]
    estimated_seconds: float
    estimated_compile_seconds: float
    estimated_step_seconds: float
    padding_fraction: float


def _rounded(lengths: Sequence[int], multiple: int, max_length: int) -> np.ndarray:
    values = np.asarray(lengths, dtype=np.int64)
    return np.minimum((values + multiple - 1) // multiple * multiple, max_length)


def _candidates(lengths: Sequence[int], multiple: int, max_length: int, limit: int = 160) -> list[int]:
    rounded = np.unique(_rounded(lengths, multiple, max_length)).tolist()
    rounded = sorted(set(rounded) | {min(round_up(max(lengths), multiple), max_length)})
    if len(rounded) <= limit:
        return rounded
    # Too many distinct lengths: keep quantiles of the length distribution, and the maximum.
    ordered = np.sort(_rounded(lengths, multiple, max_length))
    picks = {int(ordered[min(len(ordered) - 1, int(len(ordered) * q / limit))]) for q in range(1, limit + 1)}
    return sorted(picks | {rounded[-1]})


def bucket_of_each(lengths: Sequence[int], buckets: Sequence[int]) -> np.ndarray:
    """`bucket_for` of every length at once."""
    values, bounds = np.asarray(lengths, dtype=np.int64), np.asarray(buckets, dtype=np.int64)
    at = np.searchsorted(bounds, values, side="left")
    if len(values) and at.max() == len(bounds):
        raise ValueError(f"length {int(values.max())} exceeds the largest bucket {buckets[-1]}")
    return bounds[at]


def padding_fraction(lengths: Sequence[int], buckets: Sequence[int]) -> float:
    real = int(np.asarray(lengths, dtype=np.int64).sum())
    padded = int(bucket_of_each(lengths, buckets).sum())
    return 1.0 - real / padded if padded else 0.0


def _cumulative_counts(lengths: Sequence[int], cands: list[int], multiple: int, max_length: int) -> list[int]:
    """cum[j] = number of samples whose rounded length is at most cands[j]."""
    ordered = np.sort(_rounded(lengths, multiple, max_length))
    return np.searchsorted(ordered, np.asarray(cands, dtype=np.int64), side="right").tolist()


def _best_partition(segment: Callable[[int, int], float], m: int, max_buckets: int) -> tuple[list[int], float]:
    """(indices of the chosen upper bounds among m candidates, total cost): the partition of the candidates
    into at most max_buckets segments, the last ending at the last candidate, with the least summed cost."""
    inf = math.inf
    # best[b][j]: min cost covering all samples <= cands[j] with b buckets, the last ending at cands[j]
    best = [[inf] * m for _ in range(max_buckets + 1)]
    back = [[-2] * m for _ in range(max_buckets + 1)]
    for j in range(m):
        best[1][j] = segment(-1, j)
        back[1][j] = -1
    for b in range(2, max_buckets + 1):
        for j in range(m):
            for i in range(j):
                if best[b - 1][i] == inf:
                    continue
                value = best[b - 1][i] + segment(i, j)
                if value < best[b][j]:
                    best[b][j], back[b][j] = value, i
    last = m - 1
    n_best = min(range(1, max_buckets + 1), key=lambda b: (best[b][last], b))
    chosen, j, b = [], last, n_best
    while j >= 0 and b >= 1:
        chosen.append(j)
        j, b = back[b][j], b - 1
    chosen.reverse()
    return chosen, best[n_best][last]


def choose_buckets(
    lengths: Sequence[int],
    *,
    planned_batches: int,
    graphs_per_bucket: int,
    cost: StepCostModel,
    max_buckets: int,
    multiple: int,
    max_length: int,
) -> BucketChoice:
    """Boundaries minimising  n_buckets * graphs_per_bucket * compile_seconds + sum over planned batches of step time.

    Each planned batch is drawn from bucket b with probability (samples in b) / (all samples); samples are
    assigned to the smallest bucket that holds them. Exact dynamic programme over candidate boundaries.
    """
    if not lengths:
        raise ValueError("no samples to choose buckets from")
    cands = _candidates(lengths, multiple, max_length)
    cum = _cumulative_counts(lengths, cands, multiple, max_length)
    total = len(lengths)
    per_graph = graphs_per_bucket * cost.compile_seconds
    step_cost = [cost.step_seconds(c) for c in cands]

    def segment(i: int, j: int) -> float:
        """Cost of one bucket with upper bound cands[j] holding samples above cands[i] (i = -1: from 0)."""
        n = cum[j] - (cum[i] if i >= 0 else 0)
        if n == 0:
            return math.inf
        return per_graph + planned_batches * (n / total) * step_cost[j]

    indices, seconds = _best_partition(segment, len(cands), max_buckets)
    chosen = [cands[j] for j in indices]
    compile_s = len(chosen) * per_graph
    return BucketChoice(
        buckets=chosen,
        estimated_seconds=seconds,
        estimated_compile_seconds=compile_s,
        estimated_step_seconds=seconds - compile_s,
        padding_fraction=padding_fraction(np.minimum(lengths, max_length), chosen),
    )


def bucketing_seconds(
    lengths: Sequence[int], buckets: Sequence[int], *, planned_batches: int, graphs_per_bucket: int, cost: StepCostModel
) -> float:
    """The cost model's seconds for given buckets: a compile per used bucket and step kind, and planned_batches
    steps drawn from the buckets in proportion to their samples (as `choose_buckets` counts)."""
    each = bucket_of_each(np.minimum(lengths, buckets[-1]), buckets)
    used, first, sizes = np.unique(each, return_index=True, return_counts=True)
    at_first = np.argsort(first)  # in the order the samples first reach each bucket: the same sum, bit for bit
    counts = dict(zip(used[at_first].tolist(), sizes[at_first].tolist(), strict=True))
    steps = sum(planned_batches * (n / len(lengths)) * cost.step_seconds(b) for b, n in counts.items())
    return len(counts) * graphs_per_bucket * cost.compile_seconds + steps
