"""The callback side of neurontrain.lightning: preflight before step 1, progress-bar values kept on the device
and read only when the bar redraws, and `summary.json` when the fit ends (or fails).

The strategy installs these callbacks itself (first in `trainer.callbacks`, the default TQDM bar replaced), so
the user's own `callbacks=[...]` stay as they are.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar, TQDMProgressBar

from neurontrain.fileio import write_json_atomic
from neurontrain.health.preflight import preflight
from neurontrain.health.worker import device_checks
from neurontrain.lightning import internals
from neurontrain.lightning.session import Session
from neurontrain.logs import get_logger
from neurontrain.loop.dataparallel import DataParallel

log = get_logger(__name__)


class NeurontrainCallback(Callback):
    def __init__(self, session: Session) -> None:
        self.session = session
        self._summary_written = False
        self._steps_at_start = 0
        self._reads_in_training: int | None = None
        self.defer = True  # progress-bar values read by NeurontrainProgressBar (or no bar at all)
        self.dp = DataParallel()  # the workers preflight checks the collectives of (data parallel: set by it)

    def preflight(self) -> None:
        """The toolkit's device checks (`neurontrain health`'s) on this worker; HealthCheckFailed (exit 3)."""
        options = self.session.options
        if not options.preflight:
            return
        if self.session.precompile is not None and self.session.precompile.extracting:
            device_checks(self.session.backend, None)  # extraction: their graphs, not their (zero) results
            self.session.backend.sync()
            return
        recipe = SimpleNamespace(runtime=SimpleNamespace(expected_devices=options.expected_devices))
        preflight(self.session.backend, recipe, self.dp, options.output_dir)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._steps_at_start = trainer.global_step

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._reads_in_training = self.session.host_reads()  # before teardown moves everything to the host
        if self.session.precompile is not None:
            self.session.precompile.checkpoint(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        internals.restore_progress_bar_flags(self.session.deferred)
        self.session.deferred = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._steps_at_start and internals.logs_on_epoch(trainer):
            self.session.plan_epoch_values()
        if self.defer:
            session = self.session
            session.deferred = internals.defer_progress_bar_values(trainer)
            if session.stepped or session.deferred_values is None:
                session.deferred_values = None  # read when the bar next asks; between steps it shows the last

    def on_validation_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """After a loader's last batch, before Lightning reads the epoch values: each logged metric's mean
        computed in one graph and read in one transfer, so the bar's conversion and ModelCheckpoint's
        comparisons run on the host."""
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        if batch_idx + 1 == counts[dataloader_idx]:
            session = self.session
            internals.epoch_values_to_host(trainer, lambda: session.sync("eval-epoch"), session.backend.to_host)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Before Lightning reads the epoch values of what `training_step` logged with on_epoch=True (its logger,
        the bar, callbacks): computed in one graph and read in one transfer, as after a validation run."""
        if internals.logs_on_epoch(trainer):
            session = self.session
            internals.epoch_values_to_host(trainer, lambda: session.sync("train-epoch"), session.backend.to_host)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        internals.restore_progress_bar_flags(self.session.deferred)
        self.write_summary(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.write_summary(trainer)

    def write_summary(self, trainer: Any) -> None:
        """summary.json (the fields of `run`'s that apply, and the fit's graph keys and host reads)."""
        session = self.session
        if self._summary_written or session.guard is None:
            return
        self._summary_written = True
        steps = trainer.global_step - self._steps_at_start
        resumed_from = self._steps_at_start or None  # a fit restored from a checkpoint starts past step 0
        summary = session.summary(steps, trainer.world_size, self.dp.restart, resumed_from)
        reads = self._reads_in_training if self._reads_in_training is not None else session.host_reads()
        data = {
            **summary.to_json(),
            "planned_keys": [list(k) for k in session.keys],
            "compiled_keys": [list(k) for k in session.guard.compiled],
            "host_reads": reads,
            "host_reads_per_step": round(reads / steps, 3) if steps else None,
            **({"step_losses": session.step_losses} if session.step_losses else {}),
        }
        log.info(
            f"lightning: {summary.distinct_graphs} graphs ({summary.expected_graphs} planned, "
            f"{summary.unexpected_graphs} unexpected), {len(summary.hidden_host_syncs)} hidden host syncs, "
            f"{data['host_reads_per_step']} host reads per step"
        )
        if session.options.output_dir is not None and trainer.is_global_zero:
            write_json_atomic(session.options.output_dir / "summary.json", data)


class _DeviceValues:
    """Mixed into Lightning's TQDM and Rich bars: this step's progress-bar values (kept on the device by
    `NeurontrainCallback`) read in one transfer when the bar asks for its metrics, at most once a step."""

    session: Session

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        session = self.session
        if session.deferred and session.deferred_values is None:
            values = session.backend.to_host([t for _, t, _ in session.deferred])
            session.deferred_values = {name: float(v) for (name, _, _), v in zip(session.deferred, values)}
        items.update(session.deferred_values or {})
        return items


class NeurontrainTQDMProgressBar(_DeviceValues, TQDMProgressBar):
    pass


class NeurontrainRichProgressBar(_DeviceValues, RichProgressBar):
    pass


BARS = {TQDMProgressBar: NeurontrainTQDMProgressBar, RichProgressBar: NeurontrainRichProgressBar}


def install_callbacks(trainer: Any, callback: NeurontrainCallback) -> None:
    """`callback` first in `trainer.callbacks`; Lightning's TQDM or Rich bar (as configured) given the reading of
    device values (its class swapped for a subclass that adds only that). A bar of another kind is left alone
    and progress-bar values are then read as Lightning reads them."""
    callbacks = trainer.callbacks
    if callback not in callbacks:
        callbacks.insert(0, callback)
    for cb in callbacks:
        if type(cb) in BARS:
            cb.__class__ = BARS[type(cb)]
            cb.session = callback.session
    callback.defer = not any(isinstance(cb, ProgressBar) and not isinstance(cb, _DeviceValues) for cb in callbacks)
