"""Device memory one core needs to train a model, by category, for one configuration (ZeRO-1, activation
checkpointing, tensor parallel), from plain numbers: parameter shapes, config sizes, batch, length, precision.

What each category holds (bytes per core; N elements of the parameters the core holds, after tensor parallel):
  parameters   the fp32 weights (the toolkit keeps fp32 weights; `bf16` is autocast): 4 N
  gradients    fp32, one per parameter; ZeRO-1 (torch-xla's ZeroRedundancyOptimizer) keeps the full gradient
               on every worker too: 4 N
  optimizer    AdamW's exp_avg and exp_avg_sq in fp32: 8 N, or 8 x the worker's ZeRO-1 shard (each parameter
               padded on dim 0 to a multiple of the data-parallel degree, `zero_layout.shard_numel`). AdamW's
               `step` counters are host scalars and are not counted
  master       ZeRO-1's fp32 copy of the worker's shard (the weights AdamW updates): 4 x shard; none without ZeRO-1
  autocast     under `bf16`, the bf16 copy autocast makes (and caches for the step) of every weight and bias a
               matmul reads: 2 x their elements; none under `fp32`
  activations  what autograd keeps for backward, per micro-batch, summed over the layers (see `layer_bytes`)
  logits       causal LM: B x L x vocabulary logits in the compute dtype, the fp32 log-probabilities the loss
               keeps and the fp32 gradient of the logits (c + 4 + 4 bytes an element); classification: B x labels
  runtime      the Neuron runtime's own share: 96 MiB of micro-code per physical NeuronCore (Neuron's device
               memory guide) plus an assumed 10 % of the core for scratchpad, DMA rings and collectives buffers
               (the guide names these categories but gives no size)

These are what the framework holds before the compiler fuses or rematerializes anything: an upper estimate
of the tensors, not a measurement of the runtime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from neurontrain.errors import UsageError
from neurontrain.parallel.plans import resolve_rules, training_refusal
from neurontrain.parallel.rules import ShardingSpec, piece_of, rule_for, vocab_size_with_padding
from neurontrain.parallel.tensor_parallel import NXD_RULES
from neurontrain.parallel.zero_layout import shard_numel

GIB = 1 << 30
MIB = 1 << 20
CATEGORIES = ("parameters", "gradients", "optimizer", "master", "autocast", "activations", "logits", "runtime")
MICROCODE_PER_PHYSICAL_CORE = 96 * MIB
RUNTIME_FRACTION = 0.10
GATED_MLP_LEAVES = ("gate_proj.weight", "gate_up_proj.weight", "experts.gate_up_proj")  # a gated (SwiGLU) MLP


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    matmul: bool  # a weight or bias some matmul reads (autocast makes a bf16 copy of it)
    trainable: bool = True  # False: frozen (a LoRA run's base): no gradient, no optimizer state


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    family: str  # the config's model_type
    task: str  # causal-lm | sequence-classification
    params: tuple[Param, ...]
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    labels: int
    attention: str  # eager | sdpa
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    tied_embeddings: bool = False

    @property
    def numel(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)


@dataclass(frozen=True, kw_only=True)
class Workload:
    batch: int  # rows of one micro-batch on one worker
    length: int  # the longest planned sequence (the largest bucket used)
    precision: str  # fp32 | bf16
    world: int  # workers (cores) in the run
    grad_accum: int = 1  # micro-batches a step on one data-parallel worker (train.grad_accum)
    step_samples: int | None = None  # train.global_batch_size: the micro-batches follow the data-parallel degree


@dataclass(frozen=True, kw_only=True)
class Config:
    zero1: bool
    checkpointing: str  # none | full | every_N
    tp: int = 1
    fsdp: bool = False  # native backend: FSDP2 shards parameters, gradients and AdamW state over the replicas
    pp: int = 1  # pipeline stages (`pipeline_memory.py` sizes each)
    sequence_parallel: bool = False  # NxD's: the activations outside the TP-split matmuls split over the TP ranks

    def label(self) -> str:
        parts = ["FSDP" if self.fsdp else "ZeRO-1" if self.zero1 else "DP"]
        if self.checkpointing != "none":
            parts.append(f"checkpointing {self.checkpointing}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.sequence_parallel:
            parts.append("sequence parallel")
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        return " + ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Target:
    name: str  # trn1 | trn2 | trn3 | custom
    core_bytes: int  # one (logical) core's device memory
    physical_cores: int  # physical NeuronCores behind one logical core (LNC)
    source: str  # where the figure comes from


@dataclass(frozen=True)
class Estimate:
    config: Config
    bytes: dict[str, int]  # under pipeline parallel: the stage that needs the most
    capacity: int
    stages: tuple[StageEstimate, ...] = ()  # pipeline parallel: every stage

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True)
class StageEstimate:
    first_layer: int
    layers: int
    embeddings: bool  # the stage holds what comes before the first layer
    head: bool  # the stage holds what comes after the last layer (final norm, LM head, the logits)
    in_flight: int  # micro-batches whose activations the stage keeps at once
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


# Device memory per chip and NeuronCores per chip, from the Neuron architecture pages (Trainium: 32 GiB, two
# NeuronCore-v2; Trainium2: 96 GiB, eight NeuronCore-v3; Trainium3: 144 GiB, eight NeuronCore-v4). Trainium2
# and later group physical cores into logical cores (LNC, default 2: neuronx-cc "defaults to LNC=2 on Trn2 and
# later"); trn1 supports LNC 1 only.
CHIPS = {"trn1": (32, 2, 1), "trn2": (96, 8, 2), "trn3": (144, 8, 2)}  # GiB, physical cores, default LNC


def resolve_target(
    neuron_target: str, device_memory_gib: float | None, backend: str, lnc: int | None = None
) -> tuple[Target, list[str]]:
    """The core the plan must fit, and notes saying how it was chosen. `lnc`: NEURON_LOGICAL_NC_CONFIG if set."""
    notes = []
    name = neuron_target
    if name == "auto":
        name = "trn1"
        if device_memory_gib is None:
            why = "the host's target is known only once the runtime runs" if backend == "neuron" else backend
            notes.append(
                f"memory planned for trn1 (runtime.neuron_target auto: {why}), and not enforced; set "
                "runtime.neuron_target or runtime.device_memory_gib to plan for, and hold the run to, another core"
            )
    chip_gib, cores, default_lnc = CHIPS[name]
    group = 1 if name == "trn1" else (lnc or default_lnc)
    if device_memory_gib is not None:
        return Target(
            name=name if neuron_target != "auto" else "custom",
            core_bytes=int(device_memory_gib * GIB),
            physical_cores=group,
            source="runtime.device_memory_gib",
        ), notes
    per_core = chip_gib * GIB * group // cores
    source = f"{chip_gib} GiB a chip / {cores // group} {'logical ' if group > 1 else ''}cores"
    if group > 1:
        source += f" (LNC={group})"
    return Target(name=name, core_bytes=per_core, physical_cores=group, source=source), notes


def runtime_bytes(target: Target) -> int:
    return MICROCODE_PER_PHYSICAL_CORE * target.physical_cores + int(RUNTIME_FRACTION * target.core_bytes)


def sharding_spec(model: ModelShape, tp: int) -> ShardingSpec | None:
    """`checkpoint migrate`'s sharding spec for `tp`, or None where the family has no rules, NxD tensor-parallel
    training refuses it (tensor_parallel.py), or `tp` breaks the head rules (heads, KV heads) or a tensor's split."""
    rules = resolve_rules(model.family)
    if rules is None or training_refusal(model.family):
        return None
    padded = vocab_size_with_padding(model.vocab, tp)
    spec = ShardingSpec(
        family=model.family,
        tp=tp,
        pp=1,
        num_layers=model.layers,
        num_heads=model.heads,
        num_kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        vocab_size=model.vocab,
        tied_embeddings=model.tied_embeddings,
        padded_vocab_size=padded if padded != model.vocab else None,
        rules=rules,
    )
    try:
        spec.validate()
        for param in model.params:
            tp_shape(spec, param)
            if rule_for(spec, param.name) not in NXD_RULES:
                return None
    except UsageError:
        return None
    return spec


def tp_shape(spec: ShardingSpec | None, param: Param) -> tuple[int, ...]:
    """The shape of one tensor-parallel rank's piece of `param` (the whole shape without TP)."""
    shape = param.shape
    if spec is None or spec.tp == 1:
        return shape
    piece = piece_of(spec, rule_for(spec, param.name), shape, 0)
    if piece.dim is None:
        return shape
    rows = sum(stop - start for start, stop in piece.ranges) + piece.zero_rows
    return (*shape[: piece.dim], rows, *shape[piece.dim + 1 :])


def gated_mlp(model: ModelShape) -> bool:
    """A SwiGLU MLP with RMSNorms (Llama-style); otherwise a GELU MLP with LayerNorms (BERT-style)."""
    return any(p.name.endswith(GATED_MLP_LEAVES) for p in model.params)


def checkpointed_layer_count(setting: str, layers: int) -> int:
    """Layers that recompute in backward: `full` all, `every_N` layers 0, N, 2N, ... (ceil(layers / N))."""
    if setting == "none":
        return 0
    interval = 1 if setting == "full" else int(setting.removeprefix("every_"))
    return math.ceil(layers / interval)


def score_bytes(model: ModelShape, compute: int) -> int:
    """Bytes autograd keeps per attention-score element (B x heads x L x L of them). Eager attention keeps the
    fp32 softmax output (Llama upcasts it; autocast runs softmax in fp32) and the compute-dtype probabilities
    the PV matmul reads (the same tensor under fp32 without dropout), plus a 1-byte dropout mask. `sdpa` on an
    XLA device runs PyTorch's math implementation, which keeps the same tensors (checked on torch-xla 2.9:
    `SafeSoftmaxBackward` saves the fp32 result, `BmmBackward` the bf16 probabilities); Neuron's
    flash-attention kernels are reached through NxD, not through sdpa, so sdpa is counted as eager."""
    dropout = model.attention_dropout > 0
    return 4 + (1 if dropout else 0) + (compute if compute != 4 or dropout else 0)


def layer_bytes(model: ModelShape, work: Workload, tp: int, sequence_parallel: bool = False) -> int:
    """Bytes one transformer layer keeps for backward for one micro-batch (B x L tokens). Tensor parallel
    splits the attention heads and the MLP's intermediate size; the norms and the matmul inputs stay whole,
    unless sequence parallel splits them too (over the sequence, across the TP ranks).

    Gated (Llama-style) layer, per token: two RMSNorms keep their fp32 input and normalized output (4 x 4h),
    under bf16 the bf16 copies the matmuls read (2 x 2h); q, k and v (repeated to every query head) and the
    attention output (4 x heads x head_dim); gate, SiLU(gate), up and their product (4 x intermediate), all in
    the compute dtype. Standard (BERT-style) layer: the fp32 inputs of two LayerNorms (4 x 2h), the inputs of
    the QKV and intermediate matmuls (2h), q, k, v and the context (4 x heads x head_dim), the intermediate
    output and its GELU (2 x intermediate), and 1-byte hidden-dropout masks (2h).
    """
    c = 2 if work.precision == "bf16" else 4
    h, q_dim = model.hidden, model.heads * model.head_dim
    if gated_mlp(model):
        whole = 4 * 4 * h + (c * 2 * h if c != 4 else 0)
        split = c * (4 * q_dim + 4 * model.intermediate)
    else:
        whole = 4 * 2 * h + c * 2 * h + (2 * h if model.hidden_dropout > 0 else 0)
        split = c * (4 * q_dim + 2 * model.intermediate)
    tokens = work.batch * work.length
    scores = work.batch * (model.heads // tp) * work.length * work.length * score_bytes(model, c)
    return tokens * (whole // (tp if sequence_parallel else 1) + split // tp) + scores


def kept_and_recomputed(model: ModelShape, work: Workload, config: Config) -> tuple[int, int]:
    """(what one micro-batch's layers keep until their backward, what a recomputing layer adds in backward). A
    checkpointed layer keeps only its fp32 input (split by sequence parallel), and in backward one layer at a
    time holds its full activations again while it recomputes."""
    full = layer_bytes(model, work, config.tp, config.sequence_parallel)
    checkpointed = checkpointed_layer_count(config.checkpointing, model.layers)
    kept_input = work.batch * work.length * model.hidden * 4 // (config.tp if config.sequence_parallel else 1)
    recompute = full if checkpointed else 0
    return (model.layers - checkpointed) * full + checkpointed * kept_input, recompute


def activation_bytes(model: ModelShape, work: Workload, config: Config) -> int:
    """All layers, one micro-batch at a time (`kept_and_recomputed`)."""
    kept, recompute = kept_and_recomputed(model, work, config)
    return kept + recompute


def logits_bytes(model: ModelShape, work: Workload, spec: ShardingSpec | None) -> int:
    c = 2 if work.precision == "bf16" else 4
    if model.task == "causal-lm":
        vocab = spec.vocab_rows // spec.tp if spec is not None else model.vocab
        return work.batch * work.length * vocab * (c + 4 + 4)
    return work.batch * model.labels * (c + 4 + 4)


def estimate(model: ModelShape, work: Workload, config: Config, target: Target) -> Estimate:
    """Bytes by category on one core for `config` (the capacity is the target's core memory)."""
    spec = sharding_spec(model, config.tp) if config.tp > 1 else None
    if config.tp > 1 and spec is None:
        raise UsageError(
            f"parallel.tp {config.tp}: no tensor-parallel rules for this {model.family} model at that degree"
        )
    dp = max(work.world // (config.tp * config.pp), 1)
    shapes = [(tp_shape(spec, p), p.matmul) for p in model.params]
    held = sum(math.prod(shape) for shape, _ in shapes)
    sharded = config.zero1 or config.fsdp
    shard = sum(shard_numel(shape or (1,), dp) for shape, _ in shapes) if sharded else held
    matmul = sum(math.prod(shape) for shape, is_matmul in shapes if is_matmul)
    kept = shard if config.fsdp else held  # FSDP2 keeps a slice of the weights and gradients too
    trained = [shape for (shape, _), p in zip(shapes, model.params) if p.trainable]  # gradients and AdamW state
    trained_held = sum(math.prod(shape) for shape in trained)
    trained_shard = sum(shard_numel(shape or (1,), dp) for shape in trained) if sharded else trained_held
    sizes = {
        "parameters": 4 * kept,
        "gradients": 4 * (trained_shard if config.fsdp else trained_held),
        "optimizer": 8 * trained_shard,
        "master": 4 * trained_shard if config.zero1 else 0,
        "autocast": 2 * matmul if work.precision == "bf16" else 0,
        "activations": activation_bytes(model, work, config),
        "logits": logits_bytes(model, work, spec),
        "runtime": runtime_bytes(target),
    }
    return Estimate(config, sizes, target.core_bytes)
