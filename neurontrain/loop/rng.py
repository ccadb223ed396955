"""The random stream of training (dropout): each training graph is seeded from (train.seed, step, micro-batch,
worker rank) before it is traced, so what a step draws never depends on what ran before it.

Why per graph: torch-xla derives a graph's random numbers from a base seed that every sync advances, and
`torch_xla.utils.checkpoint` restores the RNG in the backward pass with `xm.set_rng_state`, which also
replaces that base seed; without reseeding, a run with activation checkpointing would draw other dropout
masks than one without from its second step on. A seed that is a function of the step also makes a resumed
run draw what the uninterrupted run drew, with no RNG state in the checkpoint.

On XLA the seed is host state only (`xm.set_rng_state`): torch-xla uploads it as the graph's seed parameter
(device data, not a constant), as it does after every sync anyway, so reseeding adds no graph, no host sync
and no recompilation. Worker 0 of a data-parallel run draws what a one-worker run draws; every other worker
draws its own stream.
"""

from __future__ import annotations

import hashlib


def graph_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """The seed of step `step`'s graph that starts with micro-batch `micro` on worker `rank`: 63 bits of a hash,
    the same in every process and Python version (torch-xla keeps the seed as a signed 64-bit integer)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{micro}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
