"""Lightning's accelerator and single-device strategy for any PJRT device (Neuron on trn1/trn2, XLA:CPU here).

Lightning 2.6's own XLA classes are for Google TPUs: `XLAAccelerator.auto_device_count` counts TPU chips on the
PCI bus (`torch_xla._internal.tpu.num_available_devices`), so on Trainium or XLA:CPU `is_available()` is false
and `accelerator="tpu"`, an `XLAAccelerator` or a `SingleDeviceXLAStrategy` raise MisconfigurationException.
These classes subclass Lightning's plain `Accelerator` and `SingleDeviceStrategy` instead: the device count
comes from the PJRT runtime, and the strategy pads each batch on the host to its bucket before it moves, cuts a
graph after every micro-batch's backward, every optimizer step and every eval batch, and feeds the guard.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden

from neurontrain.compile.neuron_runtime import prepare_runtime
from neurontrain.lightning import internals, runtime
from neurontrain.lightning.attention import static_masks
from neurontrain.lightning.callback import NeurontrainCallback, install_callbacks
from neurontrain.lightning.plan import choose_plan, eval_loader_rows
from neurontrain.lightning.session import Session
from neurontrain.loop.optim import materialize_optimizer_state
from neurontrain.model.build import move_to_device


class PJRTAccelerator(Accelerator):
    """Any device the PJRT runtime addresses: its count from `torch_xla.runtime`, not from the PCI bus."""

    def setup_device(self, device: torch.device) -> None:
        pass

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices: Any) -> int:
        if devices in ("auto", -1, None):
            return PJRTAccelerator.auto_device_count()
        return int(devices) if not isinstance(devices, list) else len(devices)

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("xla", i) for i in range(PJRTAccelerator.parse_devices(devices))]

    @staticmethod
    def auto_device_count() -> int:
        return runtime.device_count()

    @staticmethod
    def is_available() -> bool:
        try:
            return runtime.device_count() > 0
        except (ImportError, RuntimeError):  # no torch-xla, or a runtime that does not start
            return False

    @staticmethod
    def name() -> str:
        return "pjrt"

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return {}


class HostCopyCheckpointIO(TorchCheckpointIO):
    """Checkpoints with every device tensor copied to the host in one transfer (not one read per tensor)."""

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        tensors: list[torch.Tensor] = []
        apply_to_collection(checkpoint, torch.Tensor, lambda t: tensors.append(t) if t.device.type == "xla" else t)
        copies = dict(zip((id(t) for t in tensors), self.session.backend.to_host(tensors) if tensors else []))
        on_host = apply_to_collection(checkpoint, torch.Tensor, lambda t: copies.get(id(t), t))
        super().save_checkpoint(on_host, path, storage_options)


class NeurontrainStrategy(SingleDeviceStrategy):
    """One PJRT device: the module and (padded) batches on it, a sync at every graph boundary, the guard."""

    strategy_name = "neurontrain_single"

    def __init__(self, session: Session, accelerator: PJRTAccelerator) -> None:
        super().__init__(
            device=torch.device("xla", 0), accelerator=accelerator, checkpoint_io=HostCopyCheckpointIO(session)
        )
        self.session = session
        self.callback = NeurontrainCallback(session)
        self._defaults_on_host: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def root_device(self) -> torch.device:
        return self.session.backend.device

    def model_to_device(self) -> None:
        """The module on the device with its shared parameters still shared (an LM head tied to its embedding:
        a plain `.to()` to an XLA device makes one parameter per module)."""
        move_to_device(self.model, self.root_device)

    def setup_environment(self) -> None:
        """The device checks (exit 3 on failure) before anything runs on the device; neurontrain's callbacks."""
        super().setup_environment()
        prepare_runtime(self.session.options.compile_cache, [])  # where a Neuron runtime caches (else nothing)
        runtime.configure()
        install_callbacks(self.lightning_module.trainer, self.callback)
        self.callback.preflight()

    def setup(self, trainer: Any) -> None:
        """Module and optimizers on the device, the plan chosen, AdamW's state created and synced (set-up)."""
        super().setup(trainer)
        buckets, mode, rows = self.agreed_plan(
            choose_plan(trainer, self.session.options, self.lightning_module, self.session.backend.name)
        )
        evaluates = trainer.limit_val_batches != 0 and is_overridden("validation_step", self.lightning_module)
        self.session.start(buckets, mode, trainer.accumulate_grad_batches, evaluates, rows)
        if self.session.precompile is not None:
            self.session.precompile.begin(trainer, buckets)
        static_masks(self.lightning_module)
        runtime.settle_parameters(self.lightning_module)
        for optimizer in self.optimizers:
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                materialize_optimizer_state(optimizer, grads=False)
        self.session.sync("setup")

    def agreed_plan(self, plan: tuple) -> tuple:
        """The plan every worker follows (one worker: its own)."""
        return plan

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """One device: the identity, except that an integer scalar (Lightning's check of a loader's length, which
        it compares with 0 next) comes back on the host, so the comparison launches no graph."""
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 0 and not tensor.is_floating_point():
            if tensor.device.type == "xla":
                return self.session.backend.to_host([tensor])[0]
        return tensor

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        module = self.lightning_module
        training = bool(module is not None and module.trainer.training)
        rows = None if training or module is None else eval_loader_rows(module.trainer, dataloader_idx)
        return super().batch_to_device(self.session.pad(batch, training, rows), device, dataloader_idx)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.session.stepped = False
        self._bookkeeping()
        super().on_train_batch_start(batch, batch_idx)

    def _bookkeeping(self) -> None:
        """Before a step: what Lightning's logging left pending (metric states registered or reset) becomes
        the device data it refers to, then a sync for anything else (it launches nothing when nothing is)."""
        self._settle()
        self.session.sync("bookkeeping")

    def _settle(self) -> None:
        module = self.lightning_module
        for metric, name, tensor in internals.result_states(module.trainer):
            data = runtime.as_data(tensor)
            if data is not None:
                setattr(metric, name, data)
        for metric in internals.torchmetrics_objects(module.trainer, module):
            reset = [n for n in metric._defaults if runtime.as_data(getattr(metric, n, None)) is not None]
            defaults = self._host_defaults(metric) if reset else {}
            for name in reset:
                setattr(metric, name, defaults[name].to(self.root_device))

    def _host_defaults(self, metric: Any) -> dict[str, torch.Tensor]:
        """A torchmetrics object's tensor defaults on the host, read once (one transfer) per object."""
        cached = self._defaults_on_host.get(id(metric))
        if cached is None:
            names = [n for n, v in metric._defaults.items() if isinstance(v, torch.Tensor)]
            values = [metric._defaults[n] for n in names]
            on_device = [i for i, v in enumerate(values) if v.device.type == "xla"]
            host = self.session.backend.to_host([values[i] for i in on_device]) if on_device else []
            for i, value in zip(on_device, host):
                values[i] = value
            cached = self._defaults_on_host[id(metric)] = dict(zip(names, values))
        return cached

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        self._settle()  # a first `self.log` registers its metric's states here
        self.session.record_loss(out)
        return out

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        accumulating = any(p.grad is not None for p in self.lightning_module.parameters())
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        if not accumulating and self.session.accumulate > 1:
            runtime.accumulated_form(self.lightning_module)
        self.session.sync("train-accum" if accumulating else "train")
        return out

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.session.sync("optimizer")
        self.session.step += 1
        self.session.stepped = True
        return out

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._bookkeeping()
        out = super().validation_step(*args, **kwargs)
        self._settle()
        self.session.sync("eval")
        return out
