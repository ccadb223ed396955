"""A run plan described for people: what `run --dry-run` prints and a launch logs."""

from __future__ import annotations

import statistics

from neurontrain.plan.planning import RunPlan


def describe_plan(plan: RunPlan) -> dict:
    """What `run --dry-run` prints: the plan in numbers."""
    r = plan.recipe
    world = plan.world
    return {
        "recipe": r.name,
        "task": r.task,
        "backend": plan.backend,
        "model": {
            "type": plan.dims.model_type,
            "parameters": plan.dims.n_params,
            "layers": plan.dims.n_layers,
            "hidden": plan.dims.hidden,
            "source": r.model.pretrained or "config",
            "inputs": {  # as the set-up decided them from what the model accepts (model/inputs.py)
                "attention_mask": plan.dims.inputs.mask,
                "use_cache_off": plan.dims.inputs.use_cache,
                "packs": plan.dims.inputs.unpackable or True,
            },
        },
        "data": _data(plan),
        "buckets": {
            "mode": plan.bucket_mode,
            "lengths": plan.buckets,
            "used": sorted(set(plan.train_lengths_used)),
            "estimate": plan.auto_estimate,
        },
        "packing": plan.packing_summary,
        "batches_per_epoch": plan.batcher.batches_per_epoch() if plan.batcher is not None else None,
        "steps": r.train.max_steps,
        "world_size": world * plan.tp * plan.pp,
        "tensor_parallel": plan.tp,
        "pipeline_parallel": plan.pp,
        "mesh": _mesh(plan),
        "per_worker_batch": r.data.batch_size,
        "grad_accum": r.train.grad_accum,
        "effective_batch": r.data.batch_size * r.train.grad_accum * world,
        "gradient_reduction": _gradient_reduction(plan),
        "expected_graphs": [list(k) for k in plan.expected_graphs()],
        "compile_estimate": _compile_estimate(plan),
        "padding_fraction": round(plan.padding_fraction(), 4),
        "compile_cache": r.runtime.compile_cache,
        "memory": plan.memory.describe() if plan.memory is not None else None,
        "notes": plan.notes,
    }


def _data(plan: RunPlan) -> dict:
    r, stream = plan.recipe, plan.stream
    if stream is not None:  # read as the run goes: no lengths, no epoch size
        return {
            "source": r.data.source,
            "streaming": True,
            "path": r.data.path,
            "shards": len(stream.shards),
            "row_length": stream.row_length,
            "eval_samples": r.data.eval_samples,
            "eval_rows": sum(len(b.units) for b in plan.eval_batches),
        }
    lengths = plan.data.train_lengths
    return {
        "source": r.data.source,
        "train_samples": len(lengths),
        "eval_samples": len(plan.data.eval_ids),
        "tokens_min": min(lengths),
        "tokens_median": statistics.median(lengths),
        "tokens_max": max(lengths),
        "truncated": plan.data.truncated,
    }


def _mesh(plan: RunPlan) -> dict | None:
    """The native backend's DeviceMesh: data-parallel replicas (FSDP2-sharded or not) x tensor-parallel ranks."""
    if plan.backend != "native" or plan.world * plan.tp == 1:
        return None
    return {"dp": plan.world, "tp": plan.tp, "fsdp": plan.fsdp, "layout": plan_layout(plan.world, plan.tp, plan.fsdp)}


def plan_layout(dp: int, tp: int, fsdp: bool) -> str:
    """ "FSDP 2 x TP 2", "TP 2", "DDP 4", ... (pure)."""
    parts = [f"{'FSDP' if fsdp else 'DDP'} {dp}"] if dp > 1 else []
    return " x ".join(parts + ([f"TP {tp}"] if tp > 1 else [])) or "one worker"


def _gradient_reduction(plan: RunPlan) -> str:
    if plan.world == 1:
        return "none"
    collective = "reduce-scatter (ZeRO-1)" if plan.recipe.train.zero1 is True else "all-reduce"
    if plan.host_reduce:
        return f"host {collective} (gloo) between the micro-step and optimizer graphs"
    return f"in-graph {collective}"


def _compile_estimate(plan: RunPlan) -> dict:
    """The cost model's compile seconds for the plan's graphs (eager compiles none)."""
    graphs = 0 if plan.backend == "eager" else len(plan.expected_graphs())
    per_graph = plan.compile_seconds_per_graph
    return {"graphs": graphs, "seconds_per_graph": round(per_graph, 1), "seconds": round(graphs * per_graph, 1)}
