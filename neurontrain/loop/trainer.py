"""The training loop: one graph per step kind and bucket, values read in step closures, resumable. `Trainer.run`
reads top to bottom: set up (model, optimizer and data, from the newest checkpoint when resuming), then for each
step `train_step`, `maybe_eval` and `maybe_save`, then `summarize`; after every sync the recompilation guard checks
the graph that ran against the plan, and the loss watch its loss (`finite.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neurontrain.backends import Backend
from neurontrain.data.streaming import POSITION_KEY
from neurontrain.loop import checkpoints, rank_check, steps
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.finite import LossWatch, check_finite_eval, check_finite_weights, with_host_weights
from neurontrain.loop.guard import RecompilationGuard
from neurontrain.loop.metrics import MetricsWriter, StepLog
from neurontrain.loop.rng import graph_seed
from neurontrain.loop.run_facts import report_fields, run_utilisation
from neurontrain.loop.strategies import Strategy, build_strategy
from neurontrain.loop.summary import RunSummary, Throughput, build_summary
from neurontrain.model.build import build_model, host_copies, load_weights, move_to_device, save_pretrained
from neurontrain.model.packed import prepare_packed_classifier
from neurontrain.parallel.fsdp_units import planned_graph_count, transformer_layers
from neurontrain.plan.planning import RunPlan

GraphIdentifier = Callable[[list[torch.Tensor]], str]
BatchSource = Callable[[int, int], Iterator[dict]]


@dataclass
class _Restored:
    """A checkpoint's state that set-up applies after the weights: each part at the moment XLA needs it."""

    optimizer: dict
    scheduler: dict
    checkpoint: Path | None = None  # the directory (holding a ZeRO-1 checkpoint's per-rank optimizer files)


class Trainer:
    """Trains a run plan on a backend; writes metrics.jsonl, checkpoints/, model/ and summary.json to output_dir."""

    def __init__(
        self,
        plan: RunPlan,
        backend: Backend,
        output_dir: Path,
        *,
        manifest_graphs: set[str] | None = None,
        dp: DataParallel | None = None,
        graph_identifier: GraphIdentifier | None = None,
        extracting: bool = False,
        initialize: Callable[[torch.nn.Module], None] | None = None,
        initialize_optimizer: Callable[[Strategy, torch.nn.Module], None] | None = None,
        batch_source: BatchSource | None = None,
    ) -> None:
        """manifest_graphs: graph ids from a precompile manifest; each graph the run compiles is identified with
        graph_identifier (the pending graph's output tensors -> its id) and checked against them (a miss is an
        unexpected graph). dp: this worker's place among plan.world workers. extracting: the runtime only
        extracts graphs and every value is fake, so nothing of this run may be kept or resumed. initialize: sets
        the starting weights of the model built on the host (`run --init-from`), unless the run resumes;
        initialize_optimizer then the starting state of the optimizer strategy built for the device model.
        batch_source: (position, count) -> this worker's collated training micro-batches from a data service,
        instead of collating them here."""
        self.plan, self.backend, self.output_dir, self.recipe = plan, backend, output_dir, plan.recipe
        self.dp = dp or DataParallel()
        if self.dp.world != plan.world:
            raise ValueError(f"plan for {plan.world} workers run by a group of {self.dp.world}")
        if manifest_graphs is not None and graph_identifier is None:
            raise ValueError("checking graphs against manifest_graphs needs a graph_identifier")
        self.manifest_graphs, self.graph_identifier = manifest_graphs, graph_identifier
        self.extracting, self.initialize, self.initialize_optimizer = extracting, initialize, initialize_optimizer
        self.batch_source, self.writes = batch_source, self.dp.is_master and not extracting
        self.ckpt_root = output_dir / "checkpoints"
        self.start_step = self.position = 0  # position: batches of the batch order consumed so far
        self.stream_position: dict | None = None  # data.streaming: where the stream continues after them
        self.last_eval, self._identified = {}, set()  # the last evaluation's figures; graph keys identified
        self._restored: _Restored | None = None
        self.watch = LossWatch()

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Train from step 1, or from the newest checkpoint, to train.max_steps; returns the summary."""
        wall_start = time.perf_counter()
        self._set_up()
        with self.log:
            for step in range(self.start_step + 1, self.recipe.train.max_steps + 1):
                self.train_step(step)
                self.maybe_eval(step)
                self.maybe_save(step)
        if self.recipe.checkpoint.save_final and not self.extracting:
            weights = self.strategy.export_state(self.model)  # every worker: FSDP2 gathers the shards
            if self.writes:
                self._export(weights)
        return self.summarize(wall_start)

    def _set_up(self) -> None:
        """The model on the device (with a checkpoint's weights when resuming), AdamW and its schedule with
        their state created and synced (the ("setup",) graph), then a checkpoint's optimizer state loaded, the
        step log and the data stream."""
        recipe, backend = self.recipe, self.backend
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.model = build_model(recipe, self.plan.config)
        device = backend.device  # create the XLA device before any backward pass
        self._resume()
        if self.initialize is not None and self._restored is None:
            self.initialize(self.model)
        move_to_device(self.model, device)
        units = transformer_layers(self.model) if self.plan.fsdp else None  # FSDP2 compiles layer by layer
        self.planned_graphs = planned_graph_count(len(self.plan.expected_graphs()), len(units or []), self.plan.fsdp)
        prepare_packed_classifier(self.model, recipe.task, self.plan.packing)
        backend.compile_model(self.model, self.planned_graphs, units)
        self.strategy = build_strategy(self.plan, self.model, backend, self.dp)
        self._compiles_at_start, self._compile_seconds_at_start = backend.compile_count(), backend.compile_seconds()
        self.guard = RecompilationGuard(
            self.plan.expected_graphs(),
            recipe.train.recompile_guard,
            backend.compile_count,
            backend.execute_count,
            known_graphs=self.manifest_graphs,
            explain=backend.compile_notes,
            graphs_per_key=len(units) if units else 1,
            compile_seconds=backend.compile_seconds,
            compiles_new_keys=self.plan.backend == "native",
        )
        self.ranks = rank_check.for_run(self.plan, self.dp, self.start_step)
        self.strategy.materialize()
        self._sync(("setup",), self.start_step, self._state_tensors)
        # Saved optimizer state replaces the fresh state after the set-up sync, as device data: the set-up graph
        # stays the one precompile records, and the step graphs see their state as in discovery.
        if self._restored is not None:
            restored = self._restored
            self.strategy.load(restored.optimizer, restored.scheduler, restored.checkpoint)
        elif self.initialize_optimizer is not None:
            self.initialize_optimizer(self.strategy, self.model)
        resumed_at = self.start_step if self._restored is not None else None
        self.log = StepLog(
            MetricsWriter(self.output_dir, resumed_at, write=self.writes),
            total_steps=recipe.train.max_steps,
            first_step=self.start_step,
            compilations=self._compilations,
            global_counts=self.dp.sum_counts,
            utilisation=run_utilisation(recipe, self.plan, backend),
        )
        self.batches = self._train_batches()

    def train_step(self, step: int) -> None:
        """One optimizer step: forward and backward of train.grad_accum micro-batches, gradients averaged over
        the workers, clipping, AdamW and the schedule. One graph, or under split steps one per micro-batch
        and one for the optimizer."""
        plan, recipe, backend = self.plan, self.recipe, self.backend
        micro_losses: list[torch.Tensor] = []
        length = items = 0
        accum, strategy = recipe.train.grad_accum, self.strategy
        batches = [next(self.batches) for _ in range(accum)]
        self.ranks.before_train(step, [list(b["input_ids"].shape) for b in batches])
        scale = strategy.loss_scale(sum(batch["loss_items"] for batch in batches))
        for micro, batch in enumerate(batches):
            if micro == 0 or plan.split_step:  # each graph that trains draws its own stream (`loop/rng.py`)
                backend.seed_graph(graph_seed(recipe.train.seed, step, micro, self.dp.rank))
            real, n_items = batch.pop("real_tokens"), batch.pop("loss_items")
            # the loader reads ahead of the step: a stream's position travels with the batch it follows
            self.stream_position = batch.pop(POSITION_KEY, self.stream_position)
            length = batch["input_ids"].shape[1]
            self.log.count(real, batch["input_ids"].numel(), length)
            if n_items == 0 and self.dp.enabled:
                continue  # a partial last batch left this worker no rows: it adds nothing (and no NaN)
            items += n_items
            with strategy.accumulating(micro < accum - 1):
                module = strategy.training_module(self.model)
                micro_losses.append(steps.micro_step(module, batch, recipe, plan.dims, backend.autocast, scale))
            if plan.split_step:
                shapes = {"input_ids": list(batch["input_ids"].shape)}
                self._sync(("train-micro", length), step, lambda: self._state_tensors() + micro_losses[-1:], shapes)
        global_loss, lr = self.strategy.step(micro_losses, items)
        self.position += recipe.train.grad_accum
        self._log_loss(step, lr, global_loss, micro_losses)
        key = ("optimizer",) if plan.split_step else ("train", length)
        shapes = {"input_ids": [recipe.data.batch_size, length]}
        self.watch.expect(step, shapes, global_loss, micro_losses, self.backend.add_step_closure)
        self._sync(key, step, lambda: self._state_tensors() + micro_losses, shapes)
        self.watch.check()  # a non-finite loss stops the run here, before this step's checkpoint
        self.strategy.after_sync()
        self.log.advance()

    def maybe_eval(self, step: int) -> None:
        """Evaluate every train.eval_every steps and after the last one (train.eval_at_end)."""
        train = self.recipe.train
        if self.plan.eval_batches and (
            (train.eval_every and step % train.eval_every == 0) or (train.eval_at_end and step == train.max_steps)
        ):
            self.last_eval = self._evaluate(step)
            self.log.record(self.last_eval)
            check_finite_eval(self.last_eval)

    def maybe_save(self, step: int) -> None:
        """A checkpoint every checkpoint.every steps and after the last one. Every worker holds the same
        weights: worker 0 writes, between two barriers (all workers finished the step before; nobody goes on
        before the checkpoint is complete)."""
        every = self.recipe.checkpoint.every
        if not every or (step % every and step != self.recipe.train.max_steps) or self.extracting:
            return
        state = with_host_weights(self.state_dict(), self.backend.to_host, step)
        meta = self._checkpoint_meta(step)
        digest = self.strategy.parameter_digest()
        if digest is not None:
            meta["parameter_digests"] = self.dp.all_gather_object(digest)  # one per worker: all must agree
        self.dp.barrier()
        # xm.save is a collective where the xla backend spans the workers (else only worker 0 calls it)
        checkpoints.save_checkpoint(
            self.ckpt_root,
            step,
            state,
            meta,
            self.recipe.checkpoint.keep,
            self.backend.save,
            self.dp.is_master,
            all_ranks_save=self.plan.saves_collectively,
            rank_file=self.strategy.rank_state(),
            barrier=self.dp.barrier,
            shard_writer=self.strategy.shard_writer(),
        )
        self.dp.barrier()

    def summarize(self, wall_start: float) -> RunSummary:
        """The run's summary (summary.json, by worker 0): token counts over all workers, wall time after a barrier."""
        recipe, plan, backend, guard = self.recipe, self.plan, self.backend, self.guard
        losses = [r["loss"] for r in self.log.records if "loss" in r]
        real, slots = self.dp.sum_counts(self.log.real_tokens, self.log.slot_tokens)
        self.dp.barrier()
        wall = time.perf_counter() - wall_start
        summary = build_summary(
            recipe=recipe.name,
            backend=backend.name,
            steps=recipe.train.max_steps,
            losses=losses,
            compile_counts=(self._compilations(), backend.compile_seconds() - self._compile_seconds_at_start),
            guard=guard,
            expected_graphs=self.planned_graphs,
            world=plan.world,
            batch=recipe.data.batch_size,
            accum=recipe.train.grad_accum,
            throughput=Throughput(real_tokens=real, slot_tokens=slots, wall_seconds=wall),
            resumed_from_step=self.start_step or None,
            checked_against_manifest=self.manifest_graphs is not None,
            samples_trained=plan.samples_trained(),
            data=plan.data.store,
            restarts=self.dp.restart,
            buckets=plan.buckets,
            bucket_mode=plan.bucket_mode,
            buckets_used=sorted(set(plan.train_lengths_used)),
            eval_loss=self.last_eval.get("eval_loss"),
            eval_accuracy=self.last_eval.get("eval_accuracy"),
            device_bytes=self.dp.all_gather_object(self.strategy.memory(self.model)),
            rank_checks=self.ranks.counts() if self.dp.enabled else None,
            **report_fields(recipe, plan, guard.timeline, self.dp, self.log.buckets, self.log.utilisation),
        )
        if self.writes:
            summary.write(self.output_dir)
        return summary

    # -- checkpoint state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint's state.pt holds: weights (FSDP2: in the checkpoint's shards), AdamW and schedule
        state, the data position. No RNG state: each step's random stream is a function of the step
        (`loop/rng.py`)."""
        weights = self.strategy.model_state(self.model)
        return {
            **({"model": weights} if weights is not None else {}),
            "optimizer": self.strategy.state_dict(),
            "scheduler": self.strategy.scheduler.state_dict(),
            "data_position": self.position,
            **({"stream_position": self.stream_position} if self.plan.stream is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path | None = None) -> None:
        """Resume from `state` (as `state_dict` made it), into the model set-up has just built on the host. The
        weights load now, before the model moves to the device; optimizer and schedule state wait for set-up to
        build them for the device model. An RNG state in the checkpoint (written by earlier versions) is not
        needed: the step's seed is. checkpoint: the directory, for ZeRO-1's per-rank optimizer files."""
        if "model" in state:  # else FSDP2's shards: the strategy loads them once it has sharded the model
            load_weights(self.model, state["model"])  # with LoRA: the adapters only
        self.position, self.stream_position = int(state["data_position"]), state.get("stream_position")
        self._restored = _Restored(state["optimizer"], state["scheduler"], checkpoint)

    def _checkpoint_meta(self, step: int) -> dict[str, Any]:
        """meta.json: what a resumed run checks before it loads the state, and what a reader needs to know."""
        return {
            "step": step,
            "fingerprint": self.recipe.fingerprint(),
            "recipe": self.recipe.name,
            "backend": self.backend.name,
            "data_position": self.position,
            "time": time.time(),
            "world_size": self.plan.world,
            "global_fingerprint": checkpoints.global_fingerprint(self.recipe, self.plan.world),
        }

    def _resume(self) -> None:
        """With checkpoint.resume, load the newest complete checkpoint (after worker 0 removed torn ones)."""
        if not self.recipe.checkpoint.resume:
            return
        if self.dp.is_master:
            checkpoints.remove_partial(self.ckpt_root)
        self.dp.barrier()
        path = checkpoints.latest_checkpoint(self.ckpt_root)
        if path is None:
            return
        state, meta = checkpoints.load_checkpoint(path)
        checkpoints.check_resumable(path, meta, self.recipe, self.plan.world)
        self.start_step = int(meta["step"])
        self.load_state_dict(state, path)

    # -- steps ------------------------------------------------------------------------------------------------
    def _sync(
        self, key: tuple, step: int, tensors: Callable[[], list[torch.Tensor]], shapes: dict | None = None
    ) -> None:
        """Cut and run the pending graph of `key` (identified first, once, under a manifest); the guard checks it."""
        graph = None
        if self.manifest_graphs is not None and self.backend.is_xla and key not in self._identified:
            self._identified.add(key)
            graph = self.graph_identifier(tensors())
        self.backend.sync()
        try:
            self.guard.after_sync(key, step, shapes, graph=graph)
        finally:  # a worker alone with an unexpected graph is named here, before the guard's own verdict
            self.ranks.after_unexpected(self.guard.last_unexpected, self.guard.last_seconds)

    def _compilations(self) -> int:
        """Graphs compiled since set-up began."""
        return self.backend.compile_count() - self._compiles_at_start

    def _state_tensors(self) -> list[torch.Tensor]:
        return self.strategy.state_tensors(self.model)

    def _train_batches(self) -> Iterator[dict]:
        """The collated micro-batches from the run's data position to its last step, on the device."""
        recipe = self.recipe
        remaining = (recipe.train.max_steps - self.start_step) * recipe.train.grad_accum
        if self.batch_source is not None:
            stream = self.batch_source(self.position, remaining)
        else:
            stream = self.plan.train_batches(self.dp.rank, self.position, self.stream_position, remaining)
        return iter(self.backend.wrap_loader(stream, recipe.runtime.loader))

    def _log_loss(
        self, step: int, lr: float, global_loss: float | torch.Tensor | None, micro_losses: list[torch.Tensor]
    ) -> None:
        """On logged steps, record the loss: now if on the host already (host reduction), else in a step closure."""
        train = self.recipe.train
        if not (step == 1 or step % train.log_every == 0 or step == train.max_steps):
            return
        if isinstance(global_loss, float):
            self.log.train(step, lr, global_loss)
            return
        losses = [global_loss] if global_loss is not None else micro_losses
        self.backend.add_step_closure(
            lambda s, r, *x: self.log.train(s, r, sum(float(v.item()) for v in x) / len(x)), (step, lr, *losses)
        )

    def _evaluate(self, step: int) -> dict:
        totals = torch.zeros(3, dtype=torch.float64)  # loss x counted, counted, correct

        def accumulate(stats: torch.Tensor) -> None:
            totals.add_(stats.detach().cpu().to(torch.float64))

        backend = self.backend
        collate = self.plan.collator("eval", self.dp.rank)
        self.model.eval()
        loader = backend.wrap_loader((collate(b) for b in self.plan.eval_batches), self.recipe.runtime.loader)
        with torch.no_grad():
            for index, batch in enumerate(loader):
                self.ranks.before_eval(index, list(batch["input_ids"].shape), self.plan.eval_batches[index].length)
                batch.pop("real_tokens")
                if batch.pop("loss_items") == 0 and self.dp.enabled:
                    continue  # this worker's share of a partial batch is empty
                stats = steps.eval_step(self.model, batch, self.recipe, self.plan.dims, backend.autocast)
                backend.add_step_closure(accumulate, (stats,))
                shapes = {"input_ids": list(batch["input_ids"].shape)}
                self._sync(("eval", batch["input_ids"].shape[1]), step, lambda: [stats], shapes)  # noqa: B023
        self.model.train()
        self.ranks.eval_done()
        loss_sum, counted, correct = self.dp.all_reduce_host(totals).tolist()
        out = {"step": step, "eval_loss": loss_sum / counted if counted else float("nan")}
        if self.recipe.task == "sequence-classification":
            out["eval_accuracy"] = correct / counted if counted else float("nan")
        return out

    def _export(self, weights: dict) -> None:
        """Final weights in Hugging Face format (safetensors), usable on GPUs as they are."""
        target = self.output_dir / "model"
        cpu_state = host_copies(weights, self.model)
        check_finite_weights(cpu_state, self.recipe.train.max_steps, "the final model")
        save_pretrained(self.model, target, cpu_state, self.recipe)
        self.plan.data.tokenizer.save_pretrained(str(target))
