"""`neurontrain precompile --lightning "SCRIPT:FUNCTION [ARGS]"`: a short fit of the user's own module that visits
every bucket for training and evaluation and saves one checkpoint, with the plan (buckets, graph keys) the full
fit would have; every graph it cuts is recorded in a manifest from torch-xla's own dump. Where the Neuron
runtime is installed the fit runs in its extraction mode and the runtime's parallel compile phase compiles what
it extracted, into the cache the script's runs read (`trainer_args(compile_cache=...)`).

FUNCTION (given ARGS as a list when it takes a parameter) returns (LightningModule, LightningDataModule or
None, Trainer keyword arguments that include `neurontrain.lightning.trainer_args(...)`).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from neurontrain.backends import package_versions
from neurontrain.compile.cache import resolve_cache
from neurontrain.compile.manifest import GraphRecord, Manifest, plan_id
from neurontrain.compile.neuron_runtime import Extractor, check_precompile_location, prepare_runtime, toolkit_cache_dir
from neurontrain.compile.precompile import PrecompileReport, report_manifest
from neurontrain.compile.xla_dump import DUMP_FILE_ENV, DUMP_FORMAT_ENV, dump_file, dump_size, parse_dump
from neurontrain.errors import UsageError
from neurontrain.fileio import write_file_atomic, write_json_atomic
from neurontrain.lightning.args import main as script_main
from neurontrain.lightning.precompile_plan import Visits, Window, fit_graphs
from neurontrain.lightning.strategy import NeurontrainStrategy
from neurontrain.logs import get_logger

log = get_logger(__name__)


@dataclass
class PrecompileFit:
    """Held by the fit's Session: which bucket each batch goes to, and a dump window per sync."""

    scratch: Path
    dump_prefix: Path
    extractor: Extractor | None = None
    visits: Visits | None = None
    windows: list[Window] = field(default_factory=list)
    gap_dir: Path | None = None  # under extraction: where modules cut outside the fit's syncs land
    mark: int = 0

    @property
    def extracting(self) -> bool:
        return self.extractor is not None

    def target(self, training: bool) -> int | None:
        if self.visits is None:
            return None
        return self.visits.train_target() if training else self.visits.eval_target()

    def sync(self, key: tuple, shapes: dict, cut: Callable[[], int]) -> int:
        """Run one of the fit's syncs inside a window of its own (under extraction: its modules too)."""
        start = dump_size(self.dump_prefix)
        self._close_gap(start)
        t0 = time.perf_counter()
        if self.extractor is not None:
            launched: list[int] = []
            modules = self.extractor.extract(lambda: launched.append(cut()))
        else:
            launched, modules = [cut()], []
        self.mark = dump_size(self.dump_prefix)
        self.windows.append(Window(start, self.mark, key, modules, dict(shapes), time.perf_counter() - t0))
        return launched[0]

    def _close_gap(self, upto: int | None) -> None:
        modules = self.extractor.adopt(self.gap_dir) if self.extractor and self.gap_dir else []
        self.windows.append(Window(self.mark, upto, None, modules))

    def finish(self) -> None:
        self._close_gap(None)

    def begin(self, trainer: Any, buckets: list[int]) -> None:
        """After the plan is chosen (with the fit's own max_steps): train one optimizer step per bucket, one
        short epoch, validation at its end, checkpoints and logs kept out of the user's directories."""
        self.visits = Visits(list(buckets), trainer.accumulate_grad_batches)
        steps = self.visits.steps
        trainer.limit_train_batches = steps * trainer.accumulate_grad_batches
        trainer.fit_loop.epoch_loop.max_steps = steps
        trainer.val_check_interval, trainer.check_val_every_n_epoch = 1.0, 1
        if trainer.limit_val_batches != 0:
            trainer.limit_val_batches = len(buckets)
        for callback in trainer.checkpoint_callbacks:
            callback.dirpath = str(self.scratch / "checkpoints")
        trainer.loggers = []

    def checkpoint(self, trainer: Any) -> None:
        """The one checkpoint the fit saves whatever the user's checkpoint cadence."""
        trainer.save_checkpoint(self.scratch / "precompile.ckpt")


def load_build(spec: str) -> tuple[Callable, list[str], Path, str]:
    """(function, its ARGS, script path, function name) from "SCRIPT:FUNCTION [ARGS]"."""
    try:
        argv = shlex.split(spec)
    except ValueError as exc:
        raise UsageError(f"--lightning {spec!r}: {exc}") from None
    script, _, name = (argv[0] if argv else "").rpartition(":")
    if not script or not name:
        raise UsageError('--lightning needs SCRIPT:FUNCTION, e.g. --lightning "train.py:build --max-steps 1000"')
    path = Path(script)
    if not path.is_file() or path.suffix != ".py":
        raise UsageError(f"--lightning: {script} is not a Python script")
    module_spec = importlib.util.spec_from_file_location(f"neurontrain_lightning_script_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(path.resolve().parent))  # as `python SCRIPT` sees its own folder
    module_spec.loader.exec_module(module)
    function = getattr(module, name, None)
    if not callable(function):
        raise UsageError(f"--lightning: {script} has no function {name}")
    return function, argv[1:], path, name


def call_build(function: Callable, argv: list[str]) -> tuple[Any, Any, dict]:
    takes_args = bool(inspect.signature(function).parameters)
    if argv and not takes_args:
        raise UsageError(f"--lightning: {function.__name__}() takes no arguments, but {shlex.join(argv)} was given")
    result = function(argv) if takes_args else function()
    if not isinstance(result, tuple) or len(result) != 3 or not isinstance(result[2], dict):
        raise UsageError(
            f"--lightning: {function.__name__} must return (module, datamodule or None, Trainer keyword arguments)"
        )
    if not isinstance(result[2].get("strategy"), NeurontrainStrategy):
        raise UsageError(
            f"--lightning: the Trainer arguments from {function.__name__} do not include "
            "neurontrain.lightning.trainer_args(...)"
        )
    return result


def precompile_lightning(
    spec: str, cache_url: str | None, local: str | None, through_runtime: bool, workers: int | None
) -> PrecompileReport:
    scratch = Path(tempfile.mkdtemp(prefix="neurontrain-lightning-precompile-"))
    prefix = scratch / "xla-graphs"
    if os.environ.get(DUMP_FILE_ENV):
        log.warning(f"{DUMP_FILE_ENV} is set: precompile records the fit's graphs in a file of its own instead")
    os.environ[DUMP_FILE_ENV], os.environ[DUMP_FORMAT_ENV] = str(prefix), "hlo"  # before the first sync
    extractor = None
    try:
        function, argv, path, name = load_build(spec)
        module, datamodule, kwargs = call_build(function, argv)
        session = kwargs["strategy"].session
        cache = resolve_cache(cache_url or str(session.options.compile_cache), local)
        location = prepare_runtime(cache.local, []) if through_runtime else None
        check_precompile_location(location)
        cache.local = toolkit_cache_dir(location, cache.local)
        extractor = Extractor(cache.local) if through_runtime else None
        fit = PrecompileFit(scratch, prefix, extractor)
        session.precompile, session.options.output_dir = fit, scratch
        start = time.perf_counter()
        graphs = _fit(fit, module, datamodule, kwargs)
        identity = f"lightning:{path.name}:{name}:{shlex.join(argv)}"
        manifest = Manifest(
            f"lightning-{path.stem}",
            plan_id(identity, session.backend.name, kwargs.get("max_steps") or -1, session.keys),
            session.backend.name,
            versions={k: v for k, v in package_versions().items() if k in ("torch", "torch-xla", "torch-neuronx")},
        )
        manifest.graphs = [_record(cache.local, g) for g in graphs]
        manifest.discovery_seconds = round(time.perf_counter() - start, 3)
        report = report_manifest(manifest, cache.local, session.backend.name, through_runtime, workers, start)
        cache.push_after()
        return report
    finally:
        if extractor is not None:
            extractor.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _fit(fit: PrecompileFit, module: Any, datamodule: Any, kwargs: dict) -> list:
    trainer = pl.Trainer(**kwargs)
    with fit.extractor.extracting() if fit.extractor is not None else nullcontext() as gap_dir:
        fit.gap_dir = gap_dir
        trainer.fit(module, datamodule=datamodule)
        fit.finish()
    found = dump_file(fit.dump_prefix)
    if found is None:
        raise UsageError(f"torch-xla wrote no graph dump: was a graph run before precompile set {DUMP_FILE_ENV}?")
    return fit_graphs(parse_dump(found.read_bytes()), fit.windows)


def _record(cache_root: Path, graph: Any) -> GraphRecord:
    rel = f"graphs/{graph.graph_id}/model.hlo.txt"
    text = graph.hlo.encode()
    if not (cache_root / rel).is_file():
        write_file_atomic(cache_root / rel, text)
    return GraphRecord(
        list(graph.key), graph.shapes, graph.graph_id, rel, len(text), round(graph.seconds, 4), list(graph.modules)
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m neurontrain.lightning.precompile SPEC ...`: what `neurontrain precompile --lightning` starts (a
    process of its own, so torch-xla's dump is set before anything runs and the user's script is isolated)."""
    parser = argparse.ArgumentParser(prog="neurontrain precompile --lightning")
    parser.add_argument("spec")
    parser.add_argument("--cache")
    parser.add_argument("--local")
    parser.add_argument("--through-runtime", action="store_true")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--json", dest="json_file")
    args = parser.parse_args(argv)

    def run() -> None:
        report = precompile_lightning(args.spec, args.cache, args.local, args.through_runtime, args.workers)
        log.info(report.table())  # the report for people; stdout keeps the one JSON line
        if args.json_file:
            write_json_atomic(Path(args.json_file), report.to_json())
        print(json.dumps({k: v for k, v in report.to_json().items() if k != "graphs"}))
        if report.failed:
            sys.exit(1)

    script_main(run)


if __name__ == "__main__":
    main()
