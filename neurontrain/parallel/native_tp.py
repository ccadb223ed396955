"""Tensor parallel on the native backend: the model's own transformers tensor-parallel plan, applied by
transformers' own DTensor styles (`transformers.distributed.tensor_parallel.apply_tensor_parallelism`) on the
"tp" dimension of a `DeviceMesh`; FSDP2 then shards the result over its "dp" dimension (`parallel.fsdp`).

Why transformers' styles rather than `torch.distributed.tensor.parallel.parallelize_module` fed the plan: a
config's `base_model_tp_plan` names transformers' styles ("colwise", "rowwise", "embedding_rowwise",
"colwise_gather_output", "replicated_with_grad_allreduce" for Qwen3's per-head norms, packed and MoE styles), and
only some of them have a torch counterpart; translating them would be a table of ours to keep in step with
every family. transformers resolves the plan per model (its class's `_tp_plan`, the config's plan, tied
weights) and shards uneven dimensions itself (a vocabulary or width TP does not divide: the last rank holds
the shorter slice, no padding). Its styles are DTensor hooks around `nn.Linear`/`nn.Embedding` forwards, which
TorchDynamo traces into the compiled graph with the collectives in it (measured here: 2 gloo workers, tiny
Llama compiled whole, one graph, no graph break).

The model is built whole on every worker from the same seed (as on every backend), then each worker keeps its
slices (`distribute_tensor(..., src_data_rank=None)`: no communication). The plan is resolved through the
model's `_resolve_parallel_plans`, what `from_pretrained(tp_plan=...)` itself calls.
"""

from __future__ import annotations

from typing import Any

import torch

from neurontrain.errors import UsageError

PARTIAL_GRADIENTS = "replicated_with_grad_allreduce"  # transformers' style of a replicated module fed a TP slice
MESH_DIMS = ("dp", "tp")  # ranks laid out [dp, tp]: the TP ranks of a data-parallel replica are contiguous


def _distributed_config(tp: int) -> Any:
    from transformers.distributed import DistributedConfig  # lazy: transformers' distributed module is heavy

    return DistributedConfig(tp_size=tp)


def resolved_plan(model: torch.nn.Module, tp: int) -> dict[str, str]:
    """The model's tensor-parallel plan for degree `tp`, one entry per module or parameter name. UsageError for
    a family transformers has no plan for, or a plan `tp` cannot shard (heads that do not divide)."""
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank  # lazy: see _distributed_config

    config = model.config.get_text_config()
    family = config.model_type
    if not getattr(model, "tp_plan", None):
        raise UsageError(
            f"parallel.tp: {tp} on the native backend: transformers has no tensor-parallel plan for {family} "
            "(its config has no base_model_tp_plan); use parallel.fsdp, or the XLA backends' NxD layers"
        )
    try:
        plan, _, _ = model._resolve_parallel_plans(_distributed_config(tp))
    except ValueError as exc:
        raise UsageError(f"parallel.tp: {tp}: transformers' plan for {family}: {exc}") from None
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is not None and (heads % tp or get_kv_heads_per_rank(plan, kv_heads, tp) is None):
        raise UsageError(
            f"parallel.tp: {tp} does not divide {family}'s {heads} attention heads and {kv_heads} key/value heads "
            "(transformers' plan splits whole heads); choose a parallel.tp that divides both"
        )
    return plan


def device_mesh(device_type: str, dp: int, tp: int) -> Any:
    """The [dp, tp] mesh over every worker (a collective: every worker calls it)."""
    from torch.distributed.device_mesh import init_device_mesh  # lazy: only sharded native runs build a mesh

    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=MESH_DIMS)


def parallelize(model: torch.nn.Module, tp_mesh: Any) -> list[torch.nn.Module]:
    """Shard the model in place over `tp_mesh` by its plan; weights tied before stay tied (the embedding and
    the head share the one sharded parameter). Returns the modules whose parameters' gradients are partial
    sums over the TP ranks ("replicated_with_grad_allreduce": Qwen3's per-head norms), which the caller sums
    once a step. transformers' style sums them in a gradient hook it registers at the first forward (its
    parameters are placeholders before): under torch.compile that registration is state the graph guards on
    (measured: a recompile at the second step), and with accumulation it would sum each micro-batch's sum
    again."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism  # lazy: see _distributed_config

    plan = resolved_plan(model, tp_mesh.size())
    tied = _tied_pairs(model)
    modules = dict(model.named_modules())
    # a tied head's weight is the embedding's parameter (named once): sharded as the embedding's, then re-tied
    known = {name for name, _ in model.named_parameters()} | set(modules)
    partial = [modules[name] for name, style in plan.items() if style == PARTIAL_GRADIENTS and name in modules]
    kept = {name: style for name, style in plan.items() if name in known and style != PARTIAL_GRADIENTS}
    apply_tensor_parallelism(model, tp_mesh, kept)
    for (owner, name), (source, source_name) in tied:
        setattr(owner, name, getattr(source, source_name))
    return partial


def sum_partial_gradients(modules: list[torch.nn.Module], tp_group: Any) -> None:
    """Sum the gradients of `modules`' parameters over the TP ranks, in place (each worker's own slice when
    FSDP2 shards them too: the TP ranks of a replica hold the same slices)."""
    import torch.distributed as dist

    for module in modules:
        for param in module.parameters():
            if param.grad is not None:
                grad = param.grad
                dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=tp_group)


def _tied_pairs(model: torch.nn.Module) -> list[tuple[tuple[Any, str], tuple[Any, str]]]:
    """(module, attribute) pairs holding a parameter an earlier module holds too: what sharding would untie."""
    seen: dict[int, tuple[Any, str]] = {}
    pairs = []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                pairs.append(((module, name), seen[id(param)]))
            else:
                seen[id(param)] = (module, name)
    return pairs


def _replicas(grad: torch.Tensor, world: int) -> int:
    """On how many workers the same values of `grad` lie: all of them for a plain tensor, else those that hold
    the same slice (the mesh dimensions it is not sharded on, and the workers outside its mesh)."""
    placements = getattr(grad, "placements", None)
    if placements is None:
        return world
    sharded = 1
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            sharded *= grad.device_mesh.size(dim)
    return world // sharded


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_` over parameters that are DTensors on different meshes (TP's, FSDP2's, both)
    and plain replicated tensors: each worker sums the squares of its own slices, each counted once over the
    workers holding the same slice, one all-reduce over every worker; then every slice scaled in place."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    world = dist.get_world_size()
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    total = torch.zeros((), dtype=torch.float64, device=local[0].device if local else None)
    for grad, mine in zip(grads, local):
        total += mine.double().pow(2).sum() / _replicas(grad, world)
    dist.all_reduce(total)
    norm = total.sqrt().float()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for mine in local:
        mine.mul_(coef)
    return norm
