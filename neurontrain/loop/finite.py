"""A run never ends "ok" with a non-finite model: every step's loss is checked once its graph has run, and the
weights are checked on the host before a checkpoint or the final model is written.

The loss of each step is read in a step closure (after the step's graph ran: a transfer of one scalar, no
extra graph and no host sync inside the step). A NaN or infinite loss stops the run within that step, before
its checkpoint, with one line naming the step, the batch's shape and the last finite loss. A step whose loss
was finite can still leave non-finite weights (an infinite gradient): the checkpoint and export paths check
the host copies they write anyway, so nothing non-finite is published and the newest complete checkpoint
stays the last good one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from neurontrain.errors import NeurontrainError


class NonFiniteError(NeurontrainError):
    """The loss or the weights stopped being finite (exit 1); nothing of that state was written."""


def _shape_text(shapes: Mapping[str, list[int]] | None) -> str:
    if not shapes:
        return ""
    return " on a batch of " + ", ".join(f"{name} {'x'.join(map(str, shape))}" for name, shape in shapes.items())


class LossWatch:
    """The losses of a run's steps as they arrive from the device; `check` raises on the first non-finite one."""

    def __init__(self) -> None:
        self.last_finite: tuple[int, float] | None = None  # (step, loss)
        self._failure: str | None = None

    def observe(self, step: int, shapes: Mapping[str, list[int]] | None, *losses: float | torch.Tensor) -> None:
        """Record step `step`'s loss (the mean of `losses`: micro-batch losses or the global loss). Called in a
        step closure, so it does not raise there: `check` does, after the sync."""
        values = [float(v.item()) if isinstance(v, torch.Tensor) else float(v) for v in losses]
        loss = sum(values) / len(values) if values else float("nan")
        if math.isfinite(loss):
            self.last_finite = (step, loss)
        elif self._failure is None:
            self._failure = self._message(step, loss, shapes)

    def expect(
        self,
        step: int,
        shapes: Mapping[str, list[int]] | None,
        global_loss: float | torch.Tensor | None,
        micro_losses: list[torch.Tensor],
        add_step_closure: Callable[[Callable, tuple], None],
    ) -> None:
        """Observe step `step`'s loss: now when it is on the host already (host reduction), else in a step
        closure that runs after the step's sync."""
        if isinstance(global_loss, float):
            self.observe(step, shapes, global_loss)
            return
        losses = [global_loss] if global_loss is not None else micro_losses
        if losses:  # a data-parallel worker left without rows by a partial batch has no loss of its own
            add_step_closure(self.observe, (step, shapes, *losses))

    def _message(self, step: int, loss: float, shapes: Mapping[str, list[int]] | None) -> str:
        last = "no earlier step had a finite loss"
        if self.last_finite is not None:
            last = f"last finite loss {self.last_finite[1]:.6g} at step {self.last_finite[0]}"
        return (
            f"the loss is {loss} at step {step}{_shape_text(shapes)} ({last}); the run stopped before that step's "
            "checkpoint: lower train.optimizer.lr, set train.max_grad_norm, or check the data of that step"
        )

    def check(self) -> None:
        """NonFiniteError when a step's loss was not finite."""
        if self._failure is not None:
            raise NonFiniteError(self._failure)


def first_nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor (host copies) holding a NaN or an infinity, or None."""
    for name, tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def check_finite_weights(weights: Mapping[str, torch.Tensor], step: int, what: str) -> None:
    """NonFiniteError naming the first non-finite tensor of `weights` (host copies), before `what` is written."""
    name = first_nonfinite(weights.items())
    if name is not None:
        raise NonFiniteError(
            f"weight {name} is not finite after step {step}: {what} not written (the newest complete checkpoint "
            "is the last good one); lower train.optimizer.lr or set train.max_grad_norm"
        )


def with_host_weights(state: dict[str, Any], to_host: Callable[[list], list], step: int) -> dict[str, Any]:
    """A checkpoint's `state` with its weights as host copies (what the save writes anyway), checked finite first;
    unchanged when the weights are not in it (FSDP2 writes its shards itself)."""
    weights = state.get("model")
    if weights is None:
        return state
    host = dict(zip(weights, to_host(list(weights.values())), strict=True))
    check_finite_weights(host, step, f"the checkpoint of step {step}")
    return {**state, "model": host}


def check_finite_eval(result: Mapping[str, Any]) -> None:
    """NonFiniteError when an evaluation's loss is not finite (the training loss of that step was)."""
    if not math.isfinite(result["eval_loss"]):
        raise NonFiniteError(f"the eval loss is {result['eval_loss']} at step {result['step']}")
