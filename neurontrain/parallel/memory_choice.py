"""The cheapest configuration that fits one core: plain data parallel, then ZeRO-1, then activation
checkpointing, then tensor parallel; the per-core table; and, when nothing fits, what would help.

Order of the candidates (each pinned recipe value narrows it to that value):
  1. DP: every worker holds everything
  2. ZeRO-1 (only with more than one data-parallel worker)
  3. ZeRO-1 (where it applies) with activation checkpointing every_4, every_2 (where the model has more
     layers than N), then full: the fewest recomputed layers first
  4. tensor parallel (only where neuronx-distributed is importable): each degree that divides the world and
     passes the head rules of `checkpoint migrate`, smallest first, each through the same steps
  5. pipeline parallel, once tensor parallel at its largest does not fit (`pipeline_candidates`): the largest
     TP degree up to 32, then 2, 4, ... stages, each without and then with activation checkpointing
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from neurontrain.errors import UsageError
from neurontrain.parallel.memory import (
    CATEGORIES,
    GIB,
    Config,
    Estimate,
    ModelShape,
    Target,
    Workload,
    estimate,
    sharding_spec,
)
from neurontrain.parallel.pipeline_memory import describe_pipeline, pipeline_estimate

AUTO_CHECKPOINTING = ("every_4", "every_2", "full")
# The TP degree of every pipeline layout NxD Training and the Neuron SDK publish for Trainium (Llama 3 70B on trn1
# and trn2, Llama 3.1 405B): pipeline candidates keep tensor parallel within 32 ranks and add stages instead
PIPELINE_MAX_TP = 32
TABLE_COLUMNS = 8
INSTANCES = {"trn1": "trn1.32xlarge", "trn2": "trn2.48xlarge"}  # 16 chips each
CHIPS_PER_INSTANCE = 16


@dataclass(frozen=True, kw_only=True)
class Pins:
    """The recipe's non-auto choices (None: the planner decides)."""

    zero1: bool | None = None
    checkpointing: str | None = None
    tp: int | None = None
    fsdp: bool | None = None  # native backend: parallel.fsdp
    pp: int | None = None  # parallel.pp


def native_tp_degrees(model: ModelShape, world: int) -> list[int]:
    """TP degrees above 1 that divide `world`, the attention heads and the key/value heads (transformers'
    plans split whole heads: `parallel/native_tp.py`)."""
    return [t for t in tp_degrees(model, world) if model.heads % t == 0 and model.kv_heads % t == 0]


def native_estimate(model: ModelShape, work: Workload, config: Config, target: Target) -> Estimate:
    """`estimate`, but a family whose shapes the migrate rules do not shard at `config.tp` (transformers' plan
    trains it all the same: Mixtral's experts) is counted unsharded: an upper bound."""
    if config.tp > 1 and sharding_spec(model, config.tp) is None:
        whole = estimate(model, work, replace(config, tp=1), target)
        return Estimate(config, whole.bytes, whole.capacity)
    return estimate(model, work, config, target)


def native_candidates(model: ModelShape, world: int, pins: Pins, tp_available: bool) -> list[Config]:
    """The native backend's order: DP, FSDP2 (more than one replica), FSDP2 with activation checkpointing, then
    each TP degree through the same steps, FSDP2 x TP where replicas remain (DDP over TP is not built)."""
    tps = [pins.tp] if pins.tp is not None else [1] + (native_tp_degrees(model, world) if tp_available else [])
    levels = [ac for ac in AUTO_CHECKPOINTING if ac == "full" or int(ac.removeprefix("every_")) < model.layers]
    out: list[Config] = []
    for tp in tps:
        replicas = world // tp > 1
        sharded = pins.fsdp if pins.fsdp is not None else replicas
        if tp > 1 and replicas and not sharded:
            continue
        stages = [(False, "none")] if not (tp > 1 and replicas) and pins.fsdp is not True else []
        stages += [(sharded and replicas, "none")] + [(sharded and replicas, ac) for ac in levels]
        for fsdp, checkpointing in stages:
            config = Config(zero1=False, fsdp=fsdp, checkpointing=pins.checkpointing or checkpointing, tp=tp)
            if config not in out:
                out.append(config)
    return out


def pipeline_candidates(model: ModelShape, world: int, pins: Pins, tp_available: bool, native: bool) -> list[Config]:
    """Pipeline layouts: the pinned TP degree or the largest up to PIPELINE_MAX_TP, then each stage count that
    divides the world (every stage a layer at least), each without and then with activation checkpointing.
    Under NxD (not native) the stages count NxD's sequence parallelism, as its pipeline layouts run. None for
    tied embeddings (their gradient would have to be summed between the first and last stages: not built)."""
    if pins.pp == 1 or model.tied_embeddings:
        return []
    degrees = (native_tp_degrees if native else tp_degrees)(model, world) if tp_available else []
    tp = pins.tp if pins.tp is not None else max([t for t in degrees if t <= PIPELINE_MAX_TP], default=1)
    pps = [pins.pp] if pins.pp is not None else range(2, model.layers + 1)
    levels = [ac for ac in AUTO_CHECKPOINTING if ac == "full" or int(ac.removeprefix("every_")) < model.layers]
    out: list[Config] = []
    for pp in pps:
        if world % (tp * pp) or pp > model.layers:
            continue
        fsdp = native and bool(pins.fsdp) and world // (tp * pp) > 1
        split = tp > 1 and not native
        for ac in [pins.checkpointing] if pins.checkpointing else ["none", *levels]:
            out.append(Config(zero1=False, fsdp=fsdp, checkpointing=ac, tp=tp, pp=pp, sequence_parallel=split))
    return out


def tp_degrees(model: ModelShape, world: int) -> list[int]:
    """Tensor-parallel degrees above 1 that divide `world` and pass the sharding rules."""
    return [t for t in range(2, world + 1) if world % t == 0 and sharding_spec(model, t) is not None]


def candidates(model: ModelShape, world: int, pins: Pins, tp_available: bool) -> list[Config]:
    """Configurations in the order they are tried (see the module docstring)."""
    if pins.tp is not None:
        tps = [pins.tp]
    else:
        tps = [1] + (tp_degrees(model, world) if tp_available else [])
    levels = [ac for ac in AUTO_CHECKPOINTING if ac == "full" or int(ac.removeprefix("every_")) < model.layers]
    out: list[Config] = []
    for tp in tps:
        # ZeRO-1 is not combined with tensor parallel yet: `run` refuses train.zero1 with parallel.tp > 1
        sharded = pins.zero1 if pins.zero1 is not None else world // tp > 1 and tp == 1
        stages = [(False, "none")] if pins.zero1 is not True else []
        stages += [(sharded, "none")] + [(sharded, ac) for ac in levels]
        for zero1, checkpointing in stages:
            config = Config(zero1=zero1, checkpointing=pins.checkpointing or checkpointing, tp=tp)
            if config not in out:
                out.append(config)
    return out


@dataclass(kw_only=True)
class MemoryPlan:
    target: Target
    work: Workload
    tried: list[Estimate]  # in order, up to the first that fits (all of them when none does)
    choice: Estimate  # the first that fits, else the last tried (the least memory)
    enforced: bool  # nothing fitting refuses the run (Neuron, or runtime.device_memory_gib given)
    advice: str = ""  # what would help, when nothing fits
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.choice.fits

    def check(self) -> None:
        """UsageError when the run must fit and nothing does."""
        if self.enforced and not self.fits:
            raise UsageError(self.refusal())

    def refusal(self) -> str:
        core = f"a {gib(self.target.core_bytes)} GiB {self.target.name} core"
        return f"no configuration fits {core} at {self.work.world} worker(s): {self.advice}"

    def summary(self) -> str:
        """One line: the chosen configuration and its share of the core."""
        state = "fits" if self.fits else "does NOT fit"
        line = (
            f"memory: {self.choice.config.label()} {state} ({gib(self.choice.total)} of "
            f"{gib(self.target.core_bytes)} GiB a {self.target.name} core)"
        )
        first = self.tried[0]
        if first is not self.choice:
            line += f"; {first.config.label()} does not fit ({gib(first.total)} GiB)"
        return line

    def describe(self) -> dict:
        return {
            "target": self.target.name,
            "core_gib": round(self.target.core_bytes / GIB, 2),
            "core_source": self.target.source,
            "micro_batch": [self.work.batch, self.work.length],
            "precision": self.work.precision,
            "enforced": self.enforced,
            "candidates": [
                {
                    "config": _config_dict(e.config),
                    "gib": {k: round(v / GIB, 3) for k, v in e.bytes.items()},
                    "total_gib": round(e.total / GIB, 3),
                    "fits": e.fits,
                }
                for e in self.tried
            ],
            "choice": _config_dict(self.choice.config),
            "pipeline": describe_pipeline(self.choice, self.work) if self.choice.config.pp > 1 else None,
            "fits": self.fits,
            "advice": self.advice or None,
            "notes": self.notes,
        }

    def table(self) -> str:
        """The per-core table, one column per configuration tried (the last TABLE_COLUMNS of them; GiB), and
        under pipeline parallel one column per stage of the choice."""
        shown = self.tried[-TABLE_COLUMNS:]
        table = self._columns(shown, [_short(e.config) for e in shown])
        if len(shown) < len(self.tried):
            table += f"\n({len(self.tried) - len(shown)} earlier candidates do not fit; `run --dry-run` lists them)"
        stages = self.choice.stages
        if stages:
            table += "\n" + self._columns(
                [Estimate(self.choice.config, s.bytes, self.choice.capacity) for s in stages],
                [f"stage{i}:L{s.first_layer}-{s.first_layer + s.layers - 1}" for i, s in enumerate(stages)],
            )
        return table

    def _columns(self, estimates: list[Estimate], labels: list[str]) -> str:
        width = max(8, *(len(label) + 2 for label in labels))
        head = (
            f"memory per core: {self.target.name}, {gib(self.target.core_bytes)} GiB ({self.target.source}); "
            f"micro-batch {self.work.batch} x {self.work.length}, {self.work.precision}, {self.work.world} worker(s)"
        )
        rows = [head, "GiB".ljust(12) + "".join(label.rjust(width) for label in labels)]
        for category in CATEGORIES:
            rows.append(category.ljust(12) + "".join(gib(e.bytes[category]).rjust(width) for e in estimates))
        rows.append("total".ljust(12) + "".join(gib(e.total).rjust(width) for e in estimates))
        rows.append("fits".ljust(12) + "".join(("yes" if e.fits else "no").rjust(width) for e in estimates))
        return "\n".join(rows)


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _config_dict(config: Config) -> dict:
    out = {"zero1": config.zero1, "activation_checkpointing": config.checkpointing, "tp": config.tp}
    if config.pp > 1:
        out |= {"pp": config.pp, "sequence_parallel": config.sequence_parallel}
    return {**out, "fsdp": True} if config.fsdp else out  # the native backend's FSDP2


def _short(config: Config) -> str:
    parts = ["FSDP" if config.fsdp else "ZeRO-1" if config.zero1 else "DP"]
    if config.checkpointing != "none":
        parts.append(config.checkpointing)
    if config.tp > 1:
        parts.append(f"TP{config.tp}" + ("SP" if config.sequence_parallel else ""))
    if config.pp > 1:
        parts.append(f"PP{config.pp}")
    return "+".join(parts)


def plan_memory(
    model: ModelShape,
    work: Workload,
    target: Target,
    pins: Pins,
    *,
    tp_available: bool,
    enforced: bool,
    native: bool = False,
) -> MemoryPlan:
    """Try the candidates in order (the native backend's: `native_candidates`); the first that fits is the
    choice."""
    tried = []
    order = native_candidates if native else candidates
    configs = [] if pins.pp not in (None, 1) else order(model, work.world, pins, tp_available)
    configs += pipeline_candidates(model, work.world, pins, tp_available, native)
    for config in configs:
        if config.pp > 1:
            tried.append(pipeline_estimate(model, work, config, target))
        elif native:
            tried.append(native_estimate(model, work, config, target))
        else:
            tried.append(estimate(model, work, config, target))
        if tried[-1].fits:
            return MemoryPlan(target=target, work=work, tried=tried, choice=tried[-1], enforced=enforced)
    if native:
        advice = native_help(model, work, target, pins, tried[-1], tp_available)
    else:
        advice = what_would_help(model, work, target, pins, tried[-1])
    return MemoryPlan(target=target, work=work, tried=tried, choice=tried[-1], enforced=enforced, advice=advice)


def _first_fit(model: ModelShape, work: Workload, target: Target, configs: list[Config]) -> Config | None:
    return next((c for c in configs if estimate(model, work, c, target).fits), None)


def what_would_help(model: ModelShape, work: Workload, target: Target, pins: Pins, least: Estimate) -> str:
    """One sentence: the least memory tried, then the smallest world at which ZeRO-1 fits, the smallest
    tensor-parallel degree that fits, and a smaller micro-batch."""
    helps = []
    checkpointing = [pins.checkpointing] if pins.checkpointing else ["none", *AUTO_CHECKPOINTING]
    if pins.zero1 is not False and pins.tp in (None, 1):
        for world in (2**k for k in range(1, 11)):
            configs = [Config(zero1=True, checkpointing=ac) for ac in checkpointing]
            if world > work.world and _first_fit(model, replace(work, world=world), target, configs):
                helps.append(f"ZeRO-1 fits from {world} workers{_instance_hint(target, world)}")
                break
    if pins.tp is None:
        for tp in (2**k for k in range(1, 6)):
            world = max(work.world, tp) // tp * tp
            configs = [Config(zero1=False, checkpointing=ac, tp=tp) for ac in checkpointing]
            if sharding_spec(model, tp) and _first_fit(model, replace(work, world=world), target, configs):
                helps.append(f"parallel.tp {tp} with neuronx-distributed ({world} workers)")
                break
    helps.append("a smaller data.batch_size or data.max_length / largest bucket")
    return f"the least memory tried ({least.config.label()}) needs {gib(least.total)} GiB; " + ", or ".join(helps)


def native_help(
    model: ModelShape, work: Workload, target: Target, pins: Pins, least: Estimate, tp_available: bool
) -> str:
    """One sentence for the native backend: the least memory tried, then the smallest FSDP x TP layout (or
    FSDP alone, or TP alone) that fits at this number of workers or more, and a smaller micro-batch."""
    helps = []
    checkpointing = [pins.checkpointing] if pins.checkpointing else ["none", *AUTO_CHECKPOINTING]
    tps = [1] + (native_tp_degrees(model, 32) if tp_available else [])
    layouts = [(w, tp) for w in (2**k for k in range(0, 11)) if w >= work.world for tp in tps if w % tp == 0]
    for world, tp in layouts:
        fsdp = world // tp > 1
        configs = [Config(zero1=False, fsdp=fsdp, checkpointing=ac, tp=tp) for ac in checkpointing]
        if (world, tp) != (work.world, 1) and _first_fit(model, replace(work, world=world), target, configs):
            layout = " x ".join(([f"FSDP {world // tp}"] if fsdp else []) + ([f"TP {tp}"] if tp > 1 else []))
            helps.append(f"needs {layout or 'DP'} ({world} workers{_instance_hint(target, world)})")
            break
    helps.append("a smaller data.batch_size or data.max_length / largest bucket")
    return f"the least memory tried ({least.config.label()}) needs {gib(least.total)} GiB; " + ", or ".join(helps)


def _instance_hint(target: Target, world: int) -> str:
    instance = INSTANCES.get(target.name)
    if instance is None:
        return ""
    cores = CHIPS_PER_INSTANCE * (2 if target.name == "trn1" else 8 // target.physical_cores)
    if world > cores:
        return f" ({-(-world // cores)} {instance} nodes)"
    return f" (e.g. --nproc-per-node {cores} on a {instance})"
