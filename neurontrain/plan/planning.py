"""The run plan: buckets, batch order and the graphs a run will compile, known before any step runs.

`run`, `run --dry-run` and `precompile` all go through `make_plan`, so the graphs a plan lists are by
construction the graphs the loop executes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from neurontrain.backends import BACKENDS
from neurontrain.data.batching import Batcher, IndexBatch, check_targets, fixed_batches
from neurontrain.data.collate import Collator
from neurontrain.data.packing import Packing
from neurontrain.data.service import Collation
from neurontrain.data.sharding import resolve_grad_accum
from neurontrain.data.sources import PreparedData, prepare_data
from neurontrain.data.stream_source import Stream, open_stream, stream_note
from neurontrain.data.streaming import POSITION_KEY
from neurontrain.data.streaming import eval_batches as stream_eval_batches
from neurontrain.data.token_seqs import TokenSeqs
from neurontrain.errors import UsageError
from neurontrain.logs import get_logger
from neurontrain.model.build import ModelDims, build_config, meta_model, model_dims
from neurontrain.parallel.memory_choice import MemoryPlan
from neurontrain.parallel.native_tp import resolved_plan
from neurontrain.parallel.tensor_parallel import check_trainable, model_spec, require_nxd
from neurontrain.plan.buckets import Buckets, cost_model, fit_to_fixed_buckets, has_eval, with_packing
from neurontrain.plan.layouts import check_backend, pinned_stages, pinned_tp, pipeline_notes
from neurontrain.plan.memory_inputs import plan_recipe_memory, with_memory_choice
from neurontrain.plan.packing import with_packed_rows
from neurontrain.recipe import Recipe

log = get_logger(__name__)

BUCKET_MODES = ("dynamic", "max", "auto", "fixed", "packed")


@dataclass(kw_only=True)
class RunPlan:
    recipe: Recipe
    backend: str
    data: PreparedData
    config: Any
    dims: ModelDims
    buckets: list[int] | None  # None: dynamic padding
    bucket_mode: str
    batcher: Batcher | None  # global batches: data.batch_size x world rows each; None: `stream` makes them
    eval_batches: list[IndexBatch]
    train_lengths_used: list[int]
    auto_estimate: dict | None = None
    notes: list[str] = field(default_factory=list)
    world: int = 1  # data-parallel workers (all the workers divided by tp x pp)
    tp: int = 1  # tensor-parallel degree (parallel.tp, or the memory planner's choice)
    pp: int = 1  # pipeline stages (parallel.pp, or the memory planner's choice)
    host_reduce: bool = False  # gradients leave the device to be all-reduced (gloo), between two graphs
    fsdp: bool = False  # native workers shard the model with FSDP2, one unit and one compiled graph per layer
    memory: MemoryPlan | None = None  # per-core memory by category; its choice is already in `recipe`
    packing: Packing | None = None  # set: batches are packed rows (bucket mode "packed")
    packing_summary: dict | None = None  # packed against unpacked, as `run --dry-run` shows it
    stream: Stream | None = None  # data.streaming: the training rows are read and packed as the run goes

    def __post_init__(self) -> None:
        if (self.stream is None) == (self.batcher is None):
            raise ValueError("a run plan has either a batch order or a stream")
        samples = self.data.train_samples if self.stream is None else self.world
        if self.backend not in BACKENDS:
            raise UsageError(f"run plan: unknown backend {self.backend!r} (choose from {', '.join(BACKENDS)})")
        if self.world < 1:
            raise UsageError(f"run plan: {self.world} workers; a run needs at least one")
        if self.world > samples:
            raise UsageError(
                f"{self.world} workers but only {samples} training samples: every worker needs at least one "
                "sample a step"
            )
        if self.host_reduce and self.world == 1:
            raise UsageError("run plan: a host all-reduce needs more than one worker")
        if self.bucket_mode not in BUCKET_MODES:
            raise UsageError(f"run plan: bucket mode {self.bucket_mode!r} is not one of {', '.join(BUCKET_MODES)}")
        if (self.buckets is None) != (self.bucket_mode == "dynamic"):
            raise UsageError(f"run plan: bucket mode {self.bucket_mode} with buckets {self.buckets}")
        if self.buckets is not None and (self.buckets[0] < 1 or sorted(set(self.buckets)) != self.buckets):
            raise UsageError(f"run plan: buckets {self.buckets} must be positive and strictly increasing")
        if not self.train_lengths_used:
            raise UsageError("run plan: no training batch (the data yields none)")
        if self.batcher is not None and self.batcher.batch_size != self.recipe.data.batch_size * self.world:
            raise UsageError(
                f"run plan: batches of {self.batcher.batch_size} rows are not data.batch_size "
                f"{self.recipe.data.batch_size} x {self.world} workers"
            )

    def collator(self, split: str, rank: int) -> Collator:
        """Worker `rank`'s collation of the global train or eval batches."""
        data, spec = self.data, self.recipe.data
        if split == "train":
            if self.stream is not None:
                raise ValueError("a streaming plan's training batches are collated by its stream")
            if data.train_ids is None:
                raise ValueError("this plan holds the training lengths only: its batches come from the data service")
            ids, labels, size = data.train_ids, data.train_labels, spec.batch_size
        else:
            ids, labels, size = data.eval_ids, data.eval_labels, spec.eval_batch_size or spec.batch_size
        max_docs = self.packing.max_docs if self.packing is not None else None
        return Collator(ids, labels, self.recipe.task, size, data.pad_id, rank, self.world, max_docs, data.masks(split))

    def train_batches(self, rank: int, position: int, stream_position: dict | None, count: int) -> Iterator[dict]:
        """Worker `rank`'s `count` collated training micro-batches from `position` (a stream's: `stream_position`)."""
        if self.stream is not None:
            return self.stream.batches(rank, self.world, stream_position, count)
        collate = self.collator("train", rank)
        return (collate(b) for b in itertools.islice(self.batcher.iterate(position), count))

    def first_train_batch(self, rank: int, length: int) -> dict:
        """Worker `rank`'s collated first planned training batch of `length` (graph discovery traces it)."""
        if self.stream is not None:
            batch = next(self.stream.batches(rank, self.world, None, 1))
            return {k: v for k, v in batch.items() if k != POSITION_KEY}
        for planned in itertools.islice(self.batcher.iterate(0), len(self.train_lengths_used)):
            if planned.length == length:
                return self.collator("train", rank)(planned)
        raise ValueError(f"no planned training batch of length {length}")

    def collation(self, rank: int) -> Collation:
        """Worker `rank`'s collation of the training batches, for a data service that holds the ids."""
        max_docs = self.packing.max_docs if self.packing is not None else None
        spec = self.recipe.data
        return Collation(self.batcher, self.recipe.task, spec.batch_size, self.data.pad_id, rank, self.world, max_docs)

    @property
    def split_step(self) -> bool:
        """Whether a step is micro-step graphs plus an optimizer graph, rather than one graph: under gradient
        accumulation, and when the gradients are all-reduced on the host in between."""
        return self.recipe.train.grad_accum > 1 or self.host_reduce

    @property
    def saves_collectively(self) -> bool:
        """Whether every worker calls the checkpoint save (xm.save is a collective where the xla backend spans
        the workers; on XLA:CPU each worker's runtime is a world of one, so only worker 0 may call it; native's
        save is torch.save of weights every worker already holds on the host: worker 0 alone writes it)."""
        return not reduces_on_host(self.backend) and self.backend != "native"

    @property
    def step_kinds(self) -> list[str]:
        kinds = ["train-micro", "optimizer"] if self.split_step else ["train"]
        return kinds + (["eval"] if self.eval_batches else [])

    @property
    def compile_seconds_per_graph(self) -> float:
        """The cost model's compile time of one of this plan's graphs (data.auto_buckets overrides it)."""
        return cost_model(self.recipe, self.backend, self.dims).compile_seconds

    def expected_graphs(self) -> list[tuple]:
        """Graph keys: ("setup",), (kind, length) per used train/eval length, ("optimizer",) for split steps.

        On native, torch.compile compiles the model only: one TorchDynamo graph per train (or train-micro)
        length, its forward and backward (the backward compiled by AOTAutograd with it), and one per eval
        length (no_grad and eval mode are guards, so evaluation is a graph of its own). AdamW, the schedule
        and clipping run eagerly: no ("setup",) and no ("optimizer",) graph."""
        native = self.backend == "native"
        keys: list[tuple] = [] if native else [("setup",)]
        train_kind = "train-micro" if self.split_step else "train"
        keys += [(train_kind, n) for n in sorted(set(self.train_lengths_used))]
        if self.split_step and not native:
            keys.append(("optimizer",))
        keys += [("eval", n) for n in sorted({b.length for b in self.eval_batches})]
        return keys

    def _planned_train_batches(self) -> list[IndexBatch]:
        steps = self.recipe.train.max_steps * self.recipe.train.grad_accum
        assert self.batcher is not None
        return list(itertools.islice(self.batcher.iterate(0), steps))

    def planned_lengths(self) -> list[int]:
        """The length of every planned training micro-batch, in order."""
        return [batch.length for batch in self._planned_train_batches()]

    def padding_fraction(self) -> float:
        """Padded share of the token slots of the planned training batches (a stream fills every row)."""
        if self.stream is not None:
            return 0.0
        assert self.batcher is not None
        total = real = 0
        lengths = self.batcher.lengths
        for batch in self._planned_train_batches():
            total += batch.length * self.batcher.batch_size
            real += sum(min(lengths[j], batch.length) for j in batch.indices)
        return 1.0 - real / total if total else 0.0

    def samples_trained(self) -> int:
        """Training samples in the planned training batches (over all workers; a packed row holds several). A
        stream's samples are its rows, as Hugging Face's run_clm counts its blocks of grouped text."""
        if self.stream is not None:
            return self.recipe.train.max_steps * self.recipe.train.grad_accum * self.recipe.data.batch_size * self.world
        return sum(len(batch.indices) for batch in self._planned_train_batches())


def with_world(recipe: Recipe, world: int) -> Recipe:
    """The recipe as `world` workers run it: train.grad_accum derived from train.global_batch_size."""
    t = recipe.train
    accum = resolve_grad_accum(recipe.data.batch_size, world, t.grad_accum, t.global_batch_size)
    if accum == t.grad_accum:
        return recipe
    return recipe.model_copy(update={"train": t.model_copy(update={"grad_accum": accum})})


def reduces_on_host(backend: str) -> bool:
    """XLA:CPU workers under torchrun each see a world of one through xla:// (measured): their gradients are
    all-reduced with gloo on host copies. Neuron and XLA:CUDA reduce inside the graph."""
    return backend in ("xla-cpu", "eager")


def _used_lengths(batcher: Batcher, recipe: Recipe, world: int, samples: int) -> list[int]:
    try:
        return batcher.used_lengths(recipe.train.max_steps * recipe.train.grad_accum)
    except ValueError as exc:
        if world > 1:
            raise UsageError(
                f"{samples} training samples make no global batch of {recipe.data.batch_size} x {world} workers = "
                f"{recipe.data.batch_size * world} (with data.last_batch: drop); use fewer workers or a smaller "
                "data.batch_size"
            ) from None
        raise UsageError(str(exc)) from None


@dataclass
class _Batching:
    batcher: Batcher
    eval_batches: list[IndexBatch]
    used: list[int]


def _batching(recipe: Recipe, data: PreparedData, buckets: Buckets, world: int) -> _Batching:
    """The batch order for `world` data-parallel workers."""
    spec = recipe.data
    batcher = Batcher(
        lengths=tuple(data.train_lengths),
        batch_size=spec.batch_size * world,
        buckets=tuple(buckets.lengths) if buckets.lengths else None,
        shuffle=spec.shuffle,
        seed=spec.seed,
        drop_last=spec.last_batch == "drop",
        multiple=1 if buckets.mode == "dynamic" else spec.pad_to_multiple_of,
        packing=buckets.packing,
    )
    eval_batches = []
    if has_eval(recipe, data):
        eval_size = (spec.eval_batch_size or spec.batch_size) * world
        eval_batches = fixed_batches(data.eval_lengths, eval_size, buckets.lengths, packing=buckets.packing)
    return _Batching(batcher, eval_batches, _used_lengths(batcher, recipe, world, len(data.train_lengths)))


def _tensor_parallel_recipe(recipe: Recipe, config: Any, tp: int, notes: list[str]) -> Recipe:
    """Refuse what tensor parallel cannot train here (before any worker starts). The final weights are the last
    checkpoint's per-rank shards (no Hugging Face export: each worker holds only its shards): a checkpoint at
    the last step, instead of model/."""
    require_nxd(tp)
    check_trainable(model_spec(meta_model(recipe, config), tp))
    spec = recipe.checkpoint
    every = spec.every or recipe.train.max_steps
    notes.append(
        "parallel.tp: the final weights are the last checkpoint's NxD shards (checkpoints/step_*/model/; "
        "`checkpoint migrate --to gpu` merges them), not model/"
    )
    return recipe.model_copy(update={"checkpoint": spec.model_copy(update={"every": every, "save_final": False})})


def _model_parallel_recipe(
    recipe: Recipe, config: Any, backend: str, layout: tuple[int, int, int], notes: list[str]
) -> Recipe:
    """The recipe as tensor and pipeline parallel (`layout`: dp, tp, pp) train it, refused where they cannot."""
    dp, tp, pp = layout
    notes += pipeline_notes(backend, pp)
    if tp > 1 and backend == "native":
        resolved_plan(meta_model(recipe, config), tp)  # a family without a plan, heads tp does not divide: exit 2
        notes.append(f"mesh: dp {dp} x tp {tp} ({'FSDP2' if dp > 1 else 'no FSDP2'} x TP)")
    elif tp > 1:
        recipe = _tensor_parallel_recipe(recipe, config, tp, notes)
    return recipe


def make_plan(recipe: Recipe, backend: str, data: PreparedData | None = None, world: int = 1) -> RunPlan:
    """The plan for `world` workers: world / (parallel.tp x parallel.pp) data-parallel workers split each batch."""
    tp = pinned_tp(recipe, world)
    pp = pinned_stages(recipe, world, tp)
    check_backend(recipe, backend, world, tp, pp)
    if recipe.data.streaming:
        return _stream_plan(recipe, backend, world, tp)
    data = data or prepare_data(recipe)
    config = build_config(recipe, data.tokenizer)
    dims = model_dims(recipe, config)
    notes: list[str] = []
    if recipe.runtime.compiler_flags and backend != "neuron":
        notes.append(
            f"runtime.compiler_flags {recipe.runtime.compiler_flags} are neuronx-cc flags: the Neuron "
            f"runtime gets them where it is installed; {backend} never sees them"
        )
    fit_to_fixed_buckets(recipe, data)
    # the bucket choice sees the recipe's own batch size; packing may then change it, and grad_accum with it
    dp = world // (tp * pp)
    buckets = with_packing(with_world(recipe, dp), backend, data, dims, dp, notes)
    recipe = with_packed_rows(recipe, buckets.packing_summary, dp)  # auto packing: about batch_size samples a step
    run_recipe = with_world(recipe, dp)
    batching = _batching(run_recipe, data, buckets, dp)
    memory = plan_recipe_memory(run_recipe, config, backend, world, max(batching.used))
    if memory.enforced and not memory.fits:
        log.info(memory.table())
        memory.check()
    if (memory.choice.config.tp, memory.choice.config.pp) != (tp, pp):  # model parallel: fewer data-parallel workers
        tp, pp = memory.choice.config.tp, memory.choice.config.pp
        dp = world // (tp * pp)
        run_recipe = with_world(recipe, dp)
        batching = _batching(run_recipe, data, buckets, dp)
    recipe = with_memory_choice(run_recipe, memory)
    if recipe.task == "causal-lm":  # a batch without targets: NaN from its step on
        check_targets(data.train_lengths, batching.batcher.iterate(), len(batching.used), "training")
        check_targets(data.eval_lengths, batching.eval_batches, len(batching.eval_batches), "eval")
    recipe = _model_parallel_recipe(recipe, config, backend, (dp, tp, pp), notes)
    return RunPlan(
        recipe=recipe,
        backend=backend,
        data=data,
        config=config,
        dims=dims,
        buckets=buckets.lengths,
        bucket_mode=buckets.mode,
        batcher=batching.batcher,
        eval_batches=batching.eval_batches,
        train_lengths_used=batching.used,
        auto_estimate=buckets.estimate,
        notes=notes,
        world=dp,
        tp=tp,
        pp=pp,
        host_reduce=dp > 1 and reduces_on_host(backend),
        fsdp=recipe.parallel.fsdp and dp > 1,  # one replica has nothing to shard
        memory=memory,
        packing=buckets.packing,
        packing_summary=buckets.packing_summary,
    )


def _stream_plan(recipe: Recipe, backend: str, world: int, tp: int) -> RunPlan:
    """data.streaming: rows of data.max_length, one train graph; no batch order (the stream is read as the run
    goes), the eval set the stream's first documents."""
    opened = open_stream(recipe)
    config = build_config(recipe, opened.tokenizer)
    dims = model_dims(recipe, config)
    length, notes = recipe.data.max_length, [stream_note(opened.stream)]
    memory = plan_recipe_memory(with_world(recipe, world // tp), config, backend, world, length)
    if memory.enforced and not memory.fits:
        log.info(memory.table())
        memory.check()
    tp = memory.choice.config.tp
    if memory.choice.config.pp > 1:
        raise UsageError("data.streaming: pipeline parallel is not built for streamed rows; give data.path whole")
    run_recipe = with_memory_choice(with_world(recipe, world // tp), memory)
    spec = run_recipe.data
    pieces, eval_batches = stream_eval_batches(
        opened.eval_rows, (spec.eval_batch_size or spec.batch_size) * world // tp, length
    )
    store = {"streaming": True, "shards": len(opened.stream.shards)}  # nothing tokenized ahead, nothing stored
    eval_ids = TokenSeqs.from_lists(pieces)
    data = PreparedData(opened.tokenizer, opened.stream.pad_id, None, None, eval_ids, None, 0, [], store)
    if tp > 1:
        run_recipe = _tensor_parallel_recipe(run_recipe, config, tp, notes)
    steps = run_recipe.train.max_steps * run_recipe.train.grad_accum
    return RunPlan(
        recipe=run_recipe,
        backend=backend,
        data=data,
        config=config,
        dims=dims,
        buckets=[length],
        bucket_mode="packed",
        batcher=None,
        eval_batches=eval_batches,
        train_lengths_used=[length] * steps,
        notes=notes,
        world=world // tp,
        tp=tp,
        host_reduce=world // tp > 1 and reduces_on_host(backend),
        fsdp=run_recipe.parallel.fsdp and world > 1,
        memory=memory,
        packing=Packing(length),
        packing_summary={"mode": "streaming", "row_length": length, "chosen": True, "padding_fraction": 0.0},
        stream=opened.stream,
    )
