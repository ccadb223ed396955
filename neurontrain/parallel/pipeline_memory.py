"""Pipeline parallel in the memory planner: the stage split, the bubble and each stage's memory (pure).

The decoder's layers are split into `pp` consecutive stages, as even as whole layers allow; what comes before the
first layer (the embeddings) belongs to the first stage, what comes after the last (the final norm, the LM head,
a pooler or classifier) to the last, as torch.distributed.pipelining and NxD's `NxDPPModel` cut a decoder. A layer
left over goes to a middle stage first, since the first and last stages hold the embeddings and the head.

Schedules (micro-batches m, stages pp): under 1F1B, stage s (0 the first) runs pp - s forwards before its first
backward, so it keeps the activations of min(m, pp - s) micro-batches at once; under GPipe every stage keeps all m.
Either way the bubble, the share of a step a stage idles, is (pp - 1) / (m + pp - 1). The logits exist on the last
stage only, one micro-batch at a time.
"""

from __future__ import annotations

import re
from dataclasses import replace

from neurontrain.parallel.memory import (
    Config,
    Estimate,
    ModelShape,
    Param,
    StageEstimate,
    Target,
    Workload,
    estimate,
    kept_and_recomputed,
)

LAYER_INDEX = re.compile(r"\.(?:layers|layer|h|blocks)\.(\d+)\.")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def stage_layers(layers: int, pp: int) -> list[int]:
    """Decoder layers per stage: `layers // pp` each, a leftover layer to the middle stages first, then to the
    last stage, then to the first."""
    if not 1 <= pp <= layers:
        raise ValueError(f"{pp} pipeline stages for {layers} layers: every stage needs a layer")
    base, extra = divmod(layers, pp)
    counts = [base] * pp
    order = [*range(1, pp - 1), pp - 1, 0] if pp > 1 else [0]
    for stage in order[:extra]:
        counts[stage] += 1
    return counts


def bubble(pp: int, micro_batches: int) -> float:
    """The share of a step each stage idles (the pipeline filling and draining)."""
    return (pp - 1) / (micro_batches + pp - 1)


def micro_batches(work: Workload, config: Config) -> int:
    """Micro-batches a step sends through the pipeline: train.global_batch_size over the data-parallel degree
    and the micro-batch, or train.grad_accum where the recipe gives no global batch."""
    dp = max(work.world // (config.tp * config.pp), 1)
    if work.step_samples is not None:
        return max(work.step_samples // (work.batch * dp), 1)
    return work.grad_accum


def in_flight(stage: int, pp: int, micro: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations stage `stage` keeps at once (GPipe: all of them)."""
    return micro if schedule == "gpipe" else min(micro, pp - stage)


def layer_index(name: str) -> int | None:
    """The decoder layer a parameter belongs to (`model.layers.3.mlp...` -> 3), or None."""
    found = LAYER_INDEX.search(name)
    return int(found.group(1)) if found else None


def split_params(params: tuple[Param, ...], counts: list[int]) -> list[tuple[Param, ...]]:
    """Each stage's parameters: a layer's with its stage, those before the first layer with the first stage,
    those after the last layer with the last."""
    stage_of_layer = [stage for stage, n in enumerate(counts) for _ in range(n)]
    stages: list[list[Param]] = [[] for _ in counts]
    seen_layer = False
    for param in params:
        index = layer_index(param.name)
        if index is None:
            stages[len(counts) - 1 if seen_layer else 0].append(param)
        elif index >= len(stage_of_layer):
            raise ValueError(f"{param.name}: layer {index} of a {len(stage_of_layer)}-layer model")
        else:
            seen_layer = True
            stages[stage_of_layer[index]].append(param)
    return [tuple(stage) for stage in stages]


def pipeline_estimate(
    model: ModelShape, work: Workload, config: Config, target: Target, schedule: str = "1f1b"
) -> Estimate:
    """Every stage's bytes on one core of it; the estimate's bytes are the stage that needs the most."""
    counts = stage_layers(model.layers, config.pp)
    micro = micro_batches(work, config)
    stages = []
    for stage, params in enumerate(split_params(model.params, counts)):
        part = replace(model, params=params, layers=counts[stage])
        sizes = dict(estimate(part, work, config, target).bytes)
        kept, recompute = kept_and_recomputed(part, work, config)
        flying = in_flight(stage, config.pp, micro, schedule)
        sizes["activations"] = flying * kept + recompute
        last = stage == config.pp - 1
        if not last:
            sizes["logits"] = 0
        first = sum(counts[:stage])
        holds_embeddings = stage == 0
        stages.append(StageEstimate(first, counts[stage], holds_embeddings, last, flying, sizes))
    worst = max(stages, key=lambda s: s.total)
    return Estimate(config, worst.bytes, target.core_bytes, stages=tuple(stages))


def describe_pipeline(estimate_: Estimate, work: Workload, schedule: str = "1f1b") -> dict:
    """What `run --dry-run` shows of a pipeline layout: stages, micro-batches, bubble and each stage's GiB."""
    config = estimate_.config
    micro = micro_batches(work, config)
    return {
        "pp": config.pp,
        "schedule": schedule,
        "micro_batches": micro,
        "bubble": round(bubble(config.pp, micro), 4),
        "stages": [
            {
                "layers": [s.first_layer, s.first_layer + s.layers],
                "embeddings": s.embeddings,
                "head": s.head,
                "in_flight_micro_batches": s.in_flight,
                "total_gib": round(s.total / (1 << 30), 3),
                "fits": s.total <= estimate_.capacity,
            }
            for s in estimate_.stages
        ],
    }
