"""As neuronx_distributed/parallel_layers/__init__.py (NxD 2.29), the names neurontrain uses."""

from . import parallel_state  # noqa: F401
from .grads import clip_grad_norm  # noqa: F401
from .layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear  # noqa: F401
from .mappings import (  # noqa: F401
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .parallel_state import initialize_model_parallel  # noqa: F401
from .utils import copy_tensor_model_parallel_attributes, set_tensor_model_parallel_attributes  # noqa: F401
