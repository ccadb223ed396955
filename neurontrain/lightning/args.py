"""`trainer_args`: what a Lightning script adds to its `Trainer(...)` to train on a PJRT device with neurontrain's
static shapes, sync placement, recompilation guard and preflight."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from neurontrain.errors import NeurontrainError, UsageError, first_line
from neurontrain.lightning.parallel import NeurontrainDataParallelStrategy, under_torchrun
from neurontrain.lightning.runtime import xla_backend
from neurontrain.lightning.session import Options, Session
from neurontrain.lightning.strategy import NeurontrainStrategy, PJRTAccelerator
from neurontrain.loop.dataparallel import DataParallel

GUARD_MODES = ("warn", "fail", "off")


def check_not_mixed() -> None:
    """`pytorch_lightning` is a separate package whose objects Lightning's `lightning` namespace does not accept:
    one line instead of Lightning's type errors further in."""
    if "pytorch_lightning" in sys.modules:
        raise UsageError(
            "neurontrain.lightning works with the `lightning` package: this process imported `pytorch_lightning`, "
            "whose modules and trainers cannot be mixed with it (use `import lightning.pytorch as pl`)"
        )


def trainer_args(
    buckets: str | Sequence[int] = "auto",
    recompile_guard: str = "warn",
    preflight: bool = True,
    output_dir: str | Path | None = None,
    *,
    pad_values: Mapping[str, int | float] | None = None,
    pad_rows: bool = True,
    expected_devices: int | None = None,
    max_buckets: int = 6,
    pad_to_multiple_of: int = 8,
    collective_timeout: float = 600.0,
    compile_cache: str | Path = "compile_cache",
) -> dict[str, Any]:
    """Keyword arguments for `lightning.pytorch.Trainer`: neurontrain's single-device strategy on the PJRT
    accelerator (the strategy installs its callbacks itself: the user's `callbacks=[...]` are unchanged).

    buckets: "auto" (one pass over the train loader's batch lengths through the cost model) or a list of
    lengths. recompile_guard: warn, fail (stop on a graph the plan does not have) or off. preflight: the
    device checks before step 1 (HealthCheckFailed, exit 3). output_dir: where summary.json (and
    preflight.jsonl) go. pad_values: pad value per batch key (input_ids 0, attention_mask 0, labels -100 unless
    given). pad_rows: pad a partial batch with neutral rows to the loader's batch size. expected_devices: the
    device count preflight expects. collective_timeout: seconds a worker waits in a collective (under torchrun).
    compile_cache: where the Neuron runtime keeps compiled graphs (and `neurontrain precompile --lightning` puts
    them), unless NEURON_COMPILE_CACHE_URL or --cache_dir in NEURON_CC_FLAGS says otherwise.

    Under torchrun (`neurontrain run --lightning SCRIPT`) the strategy is data parallel: the workers split each
    loader (Lightning's DistributedSampler) and average their gradients (`lightning/parallel.py`).
    """
    check_not_mixed()
    if recompile_guard not in GUARD_MODES:
        raise UsageError(f"recompile_guard: choose from {', '.join(GUARD_MODES)}, not {recompile_guard!r}")
    if isinstance(buckets, str) and buckets != "auto":
        raise UsageError(f"buckets: give 'auto' or a list of lengths, not {buckets!r}")
    options = Options(
        buckets=buckets if isinstance(buckets, str) else list(buckets),
        recompile_guard=recompile_guard,
        preflight=preflight,
        output_dir=Path(output_dir) if output_dir is not None else None,
        pad_values=dict(pad_values or {}),
        pad_rows=pad_rows,
        expected_devices=expected_devices,
        max_buckets=max_buckets,
        pad_to_multiple_of=pad_to_multiple_of,
        compile_cache=Path(compile_cache),
    )
    accelerator = PJRTAccelerator()
    session = Session(options, xla_backend())
    if under_torchrun():  # `neurontrain run --lightning`, or torchrun directly: one worker of a group
        dp = DataParallel.from_env()
        return {"strategy": NeurontrainDataParallelStrategy(session, accelerator, dp, collective_timeout)}
    return {"strategy": NeurontrainStrategy(session, accelerator)}


def main(fn: Callable[[], Any]) -> None:
    """Run a script's entry point with the toolkit's exits: a neurontrain error is one line on stderr and its
    exit code (2 bad input, 1 runtime failure or an unplanned graph under `fail`, 3 failed preflight)."""
    try:
        fn()
    except NeurontrainError as exc:
        print(f"neurontrain: error: {first_line(exc, 400)}", file=sys.stderr)
        sys.exit(exc.exit_code)
