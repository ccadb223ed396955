"""The PJRT runtime as neurontrain.lightning sees it: the backend (Neuron where torch-neuronx and /dev/neuron* are
there, else XLA:CPU), the device count, syncs, and counters read synchronously on the calling thread.

Graph launches (`UncachedCompile` + `CachedCompile`) are counted when `torch_xla.sync()` or a host read cuts a
graph, before it runs: a sync with nothing pending launches none. The guard compares them with the launches of
the integration's own syncs, so a launch made elsewhere (an `.item()` on a pending value inside
`training_step`) is a hidden host sync. Host reads are torch-xla's device->host transfers.
"""

from __future__ import annotations

from typing import Any

from neurontrain.backends import Backend, select_backend


def xla_backend() -> Backend:
    """The toolkit's backend for this host: neuron when available, else xla-cpu (never eager or native)."""
    backend = select_backend("auto")
    if not backend.is_xla:
        backend = select_backend("xla-cpu")
    return backend


def configure() -> None:
    """Before the first graph, two process-wide torch-xla settings.

    No special scalars: 0 and 1 copied to the device (a fresh metric state's 0, a step count, a learning rate
    factor of 1) are device data like any other value, not constants traced into the graph that uses them. A
    constant is a graph node, so a step that adds to a fresh state traces another graph than a step that adds to
    the state a previous step left (measured: Lightning's first logged train and eval batches each compiled a
    graph of their own). Set here, not through XLA_NO_SPECIAL_SCALARS, which torch-xla reads once when it is
    imported: a script that imports torch_xla before the Trainer is built would not see it.

    No device-data cache for scalars: it gives equal scalars one shared buffer, and a graph that receives one
    buffer twice compiles differently from the same graph with two (measured: the first logged eval batch)."""
    import torch_xla  # lazy: importing torch_xla starts a runtime

    torch_xla._XLAC._set_xla_handle_special_scalars(False)
    torch_xla._XLAC._set_xla_enable_device_data_cache(False)


def device_count() -> int:
    """Devices this process can address, from the PJRT runtime."""
    import torch_xla.runtime as xr  # lazy: importing torch_xla starts a runtime

    return int(xr.addressable_runtime_device_count())


def _counter(name: str) -> int:
    import torch_xla.debug.metrics as met  # lazy: importing torch_xla starts a runtime

    return int(met.counter_value(name) or 0)


def launches() -> int:
    """Graphs cut and launched in this process so far (compiled or from the cache)."""
    return _counter("UncachedCompile") + _counter("CachedCompile")


def host_reads() -> int:
    """Device->host transfers in this process so far."""
    import torch_xla.debug.metrics as met  # lazy: importing torch_xla starts a runtime

    data = met.metric_data("TransferFromDeviceTime")
    return int(data[0]) if data else 0


def sync() -> int:
    """Cut and launch the pending graph; returns how many graphs that launched (0 when nothing was pending)."""
    import torch_xla  # lazy: importing torch_xla starts a runtime

    before = launches()
    torch_xla.sync()
    return launches() - before


def as_data(tensor: Any) -> Any | None:
    """For an XLA tensor whose pending graph is a bare reference to device data (a scalar copied to the device,
    a clone of a buffer), a tensor holding that data itself; None for anything else. XLA buffers are immutable
    (an in-place op gives the tensor a new one), so sharing one is safe. Nothing runs, nothing is read."""
    import torch_xla  # lazy: importing torch_xla starts a runtime

    if getattr(tensor, "device", None) is None or tensor.device.type != "xla":
        return None
    lines = [line for line in torch_xla._XLAC._get_xla_tensors_text([tensor]).splitlines() if " = " in line]
    if len(lines) != 1 or "xla::device_data()" not in lines[0]:
        return None
    _, data = torch_xla._XLAC._get_tensors_xla_device_data_node([tensor])
    return data[0] if len(data) == 1 else None


def settle_parameters(module: Any) -> None:
    """Give every parameter the state an optimizer step leaves it in (an in-place write of its own values), before
    the set-up sync. Without it the first training step traces a different HLO module from every later step of
    the same shape (measured: 7 weight transposes in step 1, 8 in steps 2+, one torch-xla graph hash for both):
    torch-xla compiles whichever comes first, so the module handed to the runtime would depend on which bucket
    the data put at step 1, and a precompiled cache would miss it. Values are unchanged, bit for bit."""
    import torch

    with torch.no_grad():
        for param in module.parameters():
            param.copy_(param.detach().clone())


def accumulated_form(module: Any) -> None:
    """Give the gradients of a window's first micro-batch the form accumulation leaves them in: each added in
    place to zeros, as autograd adds a later micro-batch's to it. Without it an optimizer step after a window
    of one micro-batch (an epoch's last batch when its length is not a multiple of the accumulation) traces a
    module of its own (measured with nn.TransformerEncoderLayer, accumulation 2: the optimizer graph's bias
    gradients arrive as f32[n] after one micro-batch, f32[1,1,n] after two; one compile more, at run time on
    Neuron). Parameters without a gradient keep None (AdamW skips them); values are unchanged."""
    import torch

    with torch.no_grad():
        for param in module.parameters():
            grad = param.grad
            if grad is not None:
                param.grad = torch.zeros_like(grad)
                param.grad.add_(grad)
