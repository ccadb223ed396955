"""Whether a model may load Hugging Face hub kernels: off unless the recipe asks, and then only on CUDA."""

from __future__ import annotations

from neurontrain.backends import resolve_backend_name
from neurontrain.backends.hosts import cuda_available
from neurontrain.errors import UsageError
from neurontrain.recipe import Recipe


def hub_kernels(recipe: Recipe, backend: str | None = None) -> bool:
    """Whether `from_pretrained` may replace layers with Hugging Face hub kernels: only when the recipe asks
    (model.hub_kernels) and only on CUDA. Passed explicitly, because transformers 5.25 turns them on by default
    (code fetched from the hub at run time, and `model.eval()` then refuses the XLA device)."""
    if not recipe.model.hub_kernels:
        return False
    backend = backend or resolve_backend_name(recipe.runtime.backend)
    if backend not in ("eager", "native") or not cuda_available():
        raise UsageError(
            "model.hub_kernels: Hugging Face hub kernels run on CUDA only (the eager or native backend on a GPU), "
            f"not on {backend} here"
        )
    return True
