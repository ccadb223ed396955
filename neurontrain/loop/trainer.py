"""The training loop: one graph per step kind and bucket, values read in step closures, resumable."""

from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from neurontrain.backend import Backend
from neurontrain.loop import checkpoints as ckpt
from neurontrain.compile.runtime_cache import extraction_mode
from neurontrain.data.collate import Collator
from neurontrain.errors import UsageError
from neurontrain.loop.dataparallel import DataParallel
from neurontrain.loop.guard import RecompilationGuard
from neurontrain.loop.metrics import MetricsWriter, write_summary
from neurontrain.loop import steps
from neurontrain.loop.model import build_model
from neurontrain.loop.optim import build_optimizer, build_scheduler, materialize_optimizer_state
from neurontrain.loop.planning import RunPlan


@dataclass
class _Interval:
    """Host-side counters between two logged steps."""

    start: float = field(default_factory=time.perf_counter)
    real_tokens: int = 0
    slot_tokens: int = 0


def _is_master() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _progress(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                disable=None if _is_master() else True, file=sys.stderr)


class Trainer:
    def __init__(self, plan: RunPlan, backend: Backend, output_dir: Path, manifest_graphs: set[str] | None = None,
                 dp: DataParallel | None = None) -> None:
        """manifest_graphs: graph ids from a precompile manifest; each graph the run compiles is checked
        against them (a miss is an unexpected graph). dp: this worker's place among plan.world workers."""
        self.plan, self.backend, self.output_dir = plan, backend, output_dir
        self.dp = dp or DataParallel()
        if self.dp.world != plan.world:
            raise ValueError(f"plan for {plan.world} workers run by a group of {self.dp.world}")
        self.recipe = plan.recipe
        self.ckpt_root = output_dir / "checkpoints"
        self.manifest_graphs = manifest_graphs
        self._identified: set[tuple] = set()
        # under the runtime's graph extraction every value is fake: nothing of this run may be kept or resumed
        self.extracting = extraction_mode()
        self.writes = self.dp.is_master and not self.extracting

    def _graph_id(self, key: tuple, tensors: Callable[[], list[torch.Tensor]]) -> str | None:
        """The content id of the pending graph, the first time a key runs and only when there is a manifest."""
        if self.manifest_graphs is None or not self.backend.is_xla or key in self._identified:
            return None
        from neurontrain.compile.graphs import graph_hlo, graph_id

        self._identified.add(key)
        return graph_id(graph_hlo(tensors())[0])

    # -- set-up ------------------------------------------------------------------------------------
    def _restore(self, model: torch.nn.Module) -> tuple[int, int, dict | None]:
        """(step, data position, checkpoint state) from the newest complete checkpoint, if resuming."""
        if not self.recipe.checkpoint.resume:
            return 0, 0, None
        if self.dp.is_master:
            ckpt.remove_partial(self.ckpt_root)
        self.dp.barrier()
        path = ckpt.latest_checkpoint(self.ckpt_root)
        if path is None:
            return 0, 0, None
        state, meta = ckpt.load_checkpoint(path)
        if meta.get("fingerprint") != self.recipe.fingerprint():
            raise UsageError(f"checkpoint {path} was written by a different recipe; use another --output-dir "
                             "or set checkpoint.resume=false")
        if meta.get("world_size", 1) != self.plan.world:
            raise UsageError(f"checkpoint {path} was written by {meta.get('world_size', 1)} workers, this run has "
                             f"{self.plan.world} (its data position counts global batches of that size); use "
                             "another --output-dir or the same number of workers")
        model.load_state_dict(state["model"])
        return int(meta["step"]), int(state["data_position"]), state

    # -- steps --------------------------------------------------------------------------------------
    def _evaluate(self, model: torch.nn.Module, step: int, guard: RecompilationGuard, collator: Collator) -> dict:
        totals = torch.zeros(3, dtype=torch.float64)  # loss x counted, counted, correct

        def accumulate(stats: torch.Tensor) -> None:
            totals.add_(stats.detach().cpu().to(torch.float64))

        model.eval()
        loader = self.backend.wrap_loader((collator(b) for b in self.plan.eval_batches), self.recipe.runtime.loader)
        with torch.no_grad():
            for batch in loader:
                batch.pop("real_tokens")
                if batch.pop("loss_items") == 0 and self.dp.enabled:
                    continue  # this worker's share of a partial batch is empty
                stats = steps.eval_step(model, batch, self.recipe, self.plan.dims, self.backend.autocast)
                self.backend.add_step_closure(accumulate, (stats,))
                key = ("eval", batch["input_ids"].shape[1])
                graph = self._graph_id(key, lambda: [stats])
                self.backend.sync()
                guard.after_sync(key, step, {"input_ids": list(batch["input_ids"].shape)}, graph=graph)
        model.train()
        loss_sum, counted, correct = self.dp.all_reduce_host(totals).tolist()
        out = {"step": step, "eval_loss": loss_sum / counted if counted else float("nan")}
        if self.recipe.task == "sequence-classification":
            out["eval_accuracy"] = correct / counted if counted else float("nan")
        return out

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> dict:
        wall_start = time.perf_counter()
        recipe, backend, plan = self.recipe, self.backend, self.plan
        train, data = recipe.train, recipe.data
        self.output_dir.mkdir(parents=True, exist_ok=True)

        model = build_model(recipe, plan.config)
        device = backend.device  # create the XLA device before any backward pass
        start_step, position, state = self._restore(model)
        model.to(device)
        optimizer = build_optimizer(recipe, model)
        scheduler = build_scheduler(recipe, optimizer)
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
        compiles_at_start = backend.compile_count()
        compile_seconds_at_start = backend.compile_seconds()
        guard = RecompilationGuard(plan.expected_graphs(), train.recompile_guard, backend.compile_count,
                                   backend.execute_count, report=self._report, known_graphs=self.manifest_graphs)
        materialize_optimizer_state(optimizer)
        graph = self._graph_id(("setup",), lambda: steps.state_tensors(model, optimizer))
        backend.sync()
        guard.after_sync(("setup",), start_step, graph=graph)
        # After the set-up sync: on XLA every sync advances the RNG seed, and the checkpoint recorded the
        # seed as it was after the step's own sync.
        self._seed(state)

        metrics = MetricsWriter(self.output_dir, start_step if state is not None else None, write=self.writes)
        rank, world = self.dp.rank, self.dp.world
        collator = Collator(plan.data.train_ids, plan.data.train_labels, recipe.task, data.batch_size, plan.data.pad_id,
                            rank, world)
        eval_collator = Collator(plan.data.eval_ids, plan.data.eval_labels, recipe.task,
                                 data.eval_batch_size or data.batch_size, plan.data.pad_id, rank, world)
        remaining = (train.max_steps - start_step) * train.grad_accum
        stream = (collator(b) for b in itertools.islice(plan.planner.iterate(position), remaining))
        loader = iter(backend.wrap_loader(stream, recipe.runtime.loader))
        params = [p for p in model.parameters() if p.requires_grad]
        interval = _Interval()
        totals = {"real": 0, "slots": 0}
        progress = _progress(train.max_steps, start_step)
        last_eval: dict = {}

        def log_step(step: int, lr: float, loss: float) -> None:
            now = time.perf_counter()
            seconds = max(now - interval.start, 1e-9)
            real, slots = self._global_counts(interval.real_tokens, interval.slot_tokens)
            record = {"step": step, "loss": loss, "lr": lr, "tokens_per_second": real / seconds,
                      "compilations": backend.compile_count() - compiles_at_start,
                      "padding_fraction": 1.0 - real / max(slots, 1)}
            metrics.log(record)
            progress.set_postfix(loss=f"{loss:.4f}", refresh=False)
            interval.start, interval.real_tokens, interval.slot_tokens = now, 0, 0

        for step in range(start_step + 1, train.max_steps + 1):
            micro_losses, length, items = [], 0, 0
            for _ in range(train.grad_accum):
                batch = next(loader)
                real, n_items = batch.pop("real_tokens"), batch.pop("loss_items")
                length = batch["input_ids"].shape[1]
                slots = batch["input_ids"].numel()
                interval.real_tokens += real
                interval.slot_tokens += slots
                totals["real"] += real
                totals["slots"] += slots
                if n_items == 0 and self.dp.enabled:
                    continue  # a partial last batch left this worker no rows: it adds nothing (and no NaN)
                items += n_items
                micro_losses.append(steps.micro_step(model, batch, recipe, plan.dims, backend.autocast))
                if plan.split_step:
                    key = ("train-micro", length)
                    graph = self._graph_id(key, lambda: steps.state_tensors(model, optimizer) + micro_losses[-1:])
                    backend.sync()
                    guard.after_sync(key, step, {"input_ids": list(batch["input_ids"].shape)}, graph=graph)
            log_now = step == 1 or step % train.log_every == 0 or step == train.max_steps
            global_loss = self._reduce_gradients(params, micro_losses, items)
            lr = steps.optimizer_step(params, optimizer, scheduler, recipe)
            position += train.grad_accum
            if log_now and isinstance(global_loss, float):
                log_step(step, lr, global_loss)  # host reduction: the loss is on the host already
            elif log_now:
                backend.add_step_closure(lambda s, r, *x: log_step(s, r, sum(float(v.item()) for v in x) / len(x)),
                                         (step, lr, *([global_loss] if global_loss is not None else micro_losses)))
            key = ("optimizer",) if plan.split_step else ("train", length)
            graph = self._graph_id(key, lambda: steps.state_tensors(model, optimizer) + micro_losses)
            backend.sync()
            guard.after_sync(key, step, {"input_ids": [data.batch_size, length]}, graph=graph)
            progress.update(1)

            if plan.eval_batches and ((train.eval_every and step % train.eval_every == 0)
                                      or (train.eval_at_end and step == train.max_steps)):
                last_eval = self._evaluate(model, step, guard, eval_collator)
                metrics.log(last_eval)
            every = recipe.checkpoint.every
            if every and (step % every == 0 or step == train.max_steps) and not self.extracting:
                self._save(step, position, model, optimizer, scheduler)
        progress.close()
        metrics.close()
        if recipe.checkpoint.save_final and self.writes:
            self._export(model)
        train_records = [r for r in metrics.records if "loss" in r]
        totals["real"], totals["slots"] = self._global_counts(totals["real"], totals["slots"])
        self.dp.barrier()
        wall = time.perf_counter() - wall_start
        summary = {
            "recipe": recipe.name,
            "backend": backend.name,
            "steps": train.max_steps,
            "resumed_from_step": start_step or None,
            "first_loss": train_records[0]["loss"] if train_records else None,
            "final_loss": train_records[-1]["loss"] if train_records else None,
            "compilations": backend.compile_count() - compiles_at_start,
            "compile_seconds": backend.compile_seconds() - compile_seconds_at_start,
            "distinct_graphs": guard.distinct_graphs,
            "expected_graphs": len(plan.expected_graphs()),
            "unexpected_graphs": len(guard.unexpected),
            "unexpected": guard.unexpected,
            "hidden_host_syncs": guard.hidden_syncs,
            "checked_against_manifest": self.manifest_graphs is not None,
            "world_size": plan.world,
            "per_worker_batch": data.batch_size,
            "grad_accum": train.grad_accum,
            "effective_batch": data.batch_size * plan.world * train.grad_accum,
            "restarts": self.dp.restart,
            "buckets": plan.buckets,
            "bucket_mode": plan.bucket_mode,
            "buckets_used": sorted(set(plan.train_lengths_used)),
            "tokens_per_second": totals["real"] / wall,
            "padding_fraction": 1.0 - totals["real"] / max(totals["slots"], 1),
            "wall_seconds": wall,
            **{k: v for k, v in last_eval.items() if k != "step"},
        }
        if self.writes:
            write_summary(self.output_dir, summary)
        return summary

    def _global_counts(self, real: int, slots: int) -> tuple[int, int]:
        if not self.dp.enabled:
            return real, slots
        counts = self.dp.all_reduce_host(torch.tensor([real, slots], dtype=torch.float64))
        return int(counts[0]), int(counts[1])

    def _reduce_gradients(self, params: list[torch.Tensor], micro_losses: list[torch.Tensor],
                          items: int) -> float | torch.Tensor | None:
        """Average the step's gradients over all workers. Returns the global loss (a host float after a host
        reduction, a device scalar after an in-graph one), or None with one worker."""
        if not self.dp.enabled:
            return None
        if self.plan.host_reduce:
            local = self.backend.to_host(micro_losses) if micro_losses else []
            mean = sum(float(x) for x in local) / len(local) if local else 0.0
            stats = self.dp.reduce_on_host(params, self.backend, torch.tensor([mean * items, items], dtype=torch.float64))
            return float(stats[0] / max(float(stats[1]), 1.0))
        device = self.backend.device
        weight = torch.tensor(float(items)).to(device)
        mean = torch.stack(micro_losses).mean() if micro_losses else torch.zeros((), device=device)
        total = self.dp.reduce_in_graph(params, weight)
        import torch_xla.core.xla_model as xm

        return xm.all_reduce(xm.REDUCE_SUM, mean * weight) / total.clamp(min=1.0)

    def _seed(self, state: dict | None) -> None:
        """Restore the RNG of a resumed run (this worker's own, when the checkpoint has one per worker); a fresh
        run with several workers gives each its own dropout stream (worker 0 keeps the one-worker stream)."""
        backend = self.backend
        if state is not None:
            rng = state["rng"]
            per_rank = rng.get("per_rank")
            mine = per_rank[self.dp.rank] if per_rank and len(per_rank) == self.dp.world else rng
            torch.set_rng_state(mine["torch_cpu"])
            backend.set_rng_state(mine["backend"])
        elif self.dp.enabled and self.dp.rank:
            torch.manual_seed(self.recipe.train.seed + 7919 * self.dp.rank)
            if backend.is_xla:
                backend.set_rng_state(int(backend.rng_state()) + 7919 * self.dp.rank)

    def _report(self, message: str) -> None:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)

    def _save(self, step: int, position: int, model, optimizer, scheduler) -> None:
        """Every worker holds the same weights: worker 0 writes, between two barriers (all workers finished the
        step before; nobody goes on before the checkpoint is complete)."""
        rng = {"torch_cpu": torch.get_rng_state(), "backend": self.backend.rng_state()}
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "data_position": position,
            "rng": {**rng, "per_rank": self.dp.all_gather_object(rng) if self.dp.enabled else None},
        }
        meta = {"step": step, "fingerprint": self.recipe.fingerprint(), "recipe": self.recipe.name,
                "backend": self.backend.name, "data_position": position, "time": time.time(),
                "world_size": self.plan.world}
        self.dp.barrier()
        # xm.save is a collective where the xla backend spans the workers; on host-reduce backends each
        # worker's runtime is a world of one, so only worker 0 calls it.
        ckpt.save_checkpoint(self.ckpt_root, step, state, meta, self.recipe.checkpoint.keep, self.backend.save,
                             self.dp.is_master, all_ranks_save=not self.plan.host_reduce)
        self.dp.barrier()

    def _export(self, model: torch.nn.Module) -> None:
        """Final weights in Hugging Face format (safetensors), usable on GPUs as they are."""
        target = self.output_dir / "model"
        cpu_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        model.save_pretrained(str(target), state_dict=cpu_state)
        self.plan.data.tokenizer.save_pretrained(str(target))
