"""Which transformer layers recompute their activations in the backward pass (activation checkpointing).

`train.activation_checkpointing` reads `none`, `full` (every layer), `every_N` (layers 0, N, 2N, ...: Hugging
Face's `every_n_layers` rule, so a model with L layers checkpoints ceil(L / N) of them) or `auto` (the memory
planner's choice; read as `none` until the plan has resolved it).
"""

from __future__ import annotations

import re

from neurontrain.errors import UsageError

_EVERY = re.compile(r"every_([1-9][0-9]*)")


def checkpoint_interval(setting: str) -> int | None:
    """N for `every_N` (1 for `full`); None when no layer is checkpointed (`none`, and `auto` unresolved)."""
    if setting in ("none", "auto"):
        return None
    if setting == "full":
        return 1
    match = _EVERY.fullmatch(setting)
    if match is None:
        raise UsageError(
            f"train.activation_checkpointing: {setting!r} is not one of none, full, every_N (N >= 1) or auto"
        )
    return int(match.group(1))


def checkpointed_layers(setting: str, num_layers: int) -> list[int]:
    """Indices of the layers that are checkpointed, in order."""
    interval = checkpoint_interval(setting)
    if interval is None:
        return []
    return list(range(0, num_layers, interval))
