"""The doctor's checks. Each is a function of the shared `DoctorContext` returning a `Verdict`, or raising `Skip`
with the reason; the runs they need come from the context (once each), so any check can run alone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from neurontrain.backends import neuron_devices, neuron_runtime_present, package_versions, resolve_backend_name
from neurontrain.backends.native import torchneuron_host
from neurontrain.checkpoint.migrate import MigrateOptions, migrate
from neurontrain.checkpoint.verify import verify
from neurontrain.compile.cache import default_local
from neurontrain.compile.neuron_runtime import compiler_view, host_product_name
from neurontrain.compile.runtime_cache import (
    gained_neff,
    platform_target,
    runtime_cache_location,
    runtime_compiler_flags,
    scan_modules,
)
from neurontrain.doctor import verdicts
from neurontrain.doctor.context import PER_WORKER_BATCH, DoctorContext, StageFailed, losses, read_json
from neurontrain.doctor.report import Verdict, failed, passed


class Skip(Exception):
    """The check does not apply here; its message is the reason."""


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[DoctorContext], Verdict]
    quick: bool  # part of --quick (every check is part of --full)


# -- 1. environment --------------------------------------------------------------------------------------------
def check_environment(ctx: DoctorContext) -> Verdict:
    runtime = neuron_runtime_present()
    location = runtime_cache_location(os.environ, str(default_local()))
    root = Path(location.root)
    facts = {
        "product": host_product_name(),
        "devices": neuron_devices(),
        "backend": resolve_backend_name("auto"),
        "requested_backend": ctx.backend,
        "runtime": runtime,
        "cache_root": location.root,
        "cache_decided_by": location.source,
        "cache_writable": _writable(root) if location.is_local else None,
        "compiler": compiler_view([]) if runtime else {},
        "packages": {k: v for k, v in package_versions().items() if v},
    }
    return verdicts.environment_verdict(facts)


def _writable(root: Path) -> bool:
    existing = next((p for p in (root, *root.parents) if p.exists()), Path("/"))
    return os.access(existing, os.W_OK)


# -- 2. compile once, hit everywhere ---------------------------------------------------------------------------
def _needs_runtime(ctx: DoctorContext) -> None:
    if resolve_backend_name(ctx.backend) == "native":
        raise Skip("the native backend compiles through torch.compile, not the Neuron runtime's cache")
    if not ctx.has_module("libneuronxla"):
        raise Skip("no Neuron runtime installed (libneuronxla, part of torch-neuronx)")


def precompiled(ctx: DoctorContext, workers: int) -> list[str]:
    """The manifest's module directories after `precompile` at `workers` workers into the scratch cache."""

    def make() -> list[str]:
        report = ctx.scratch / f"precompile-{workers}.json"
        ctx.cli(f"precompile-{workers}", "precompile", *ctx.recipe_args(workers), "--json", str(report))
        manifest = read_json(read_json(report)["manifest"])
        return sorted({m for g in manifest["graphs"] for m in g["modules"]})

    return ctx.once(f"precompile-{workers}", make)


def trained(ctx: DoctorContext, workers: int) -> Path:
    """The run of the doctor's recipe at `workers` workers (after its precompile where a runtime is installed);
    the cache's modules just before and after it are kept as ctx.modules[workers] = (before, after)."""

    def make() -> Path:
        if ctx.has_module("libneuronxla") and resolve_backend_name(ctx.backend) != "native":
            precompiled(ctx, workers)
        out, before = ctx.scratch / f"run-{workers}", scan_modules(ctx.cache)
        ctx.cli(f"run-{workers}", "run", *ctx.recipe_args(workers), "--output-dir", str(out))
        ctx.modules[workers] = (before, scan_modules(ctx.cache))
        return out

    return ctx.once(f"run-{workers}", make)


def _flags_of(modules: dict[str, str], root: Path) -> dict[str, list[str]]:
    out = {}
    for name in modules:
        path = root / name / "compile_flags.json"
        if path.exists():
            out[name] = json.loads(path.read_text())
    return out


def _compile_verdict(ctx: DoctorContext, workers: int) -> Verdict:
    manifest = precompiled(ctx, workers)
    run = trained(ctx, workers)
    before, after = ctx.modules[workers]
    target = platform_target(ctx.env, host_product_name())
    predicted = runtime_compiler_flags(ctx.env, [], target) if target else None
    return verdicts.compile_once_verdict(
        workers, manifest, before, after, read_json(run / "summary.json"), _flags_of(after, ctx.cache), predicted
    )


def extracted(ctx: DoctorContext) -> Verdict:
    """An extraction-mode run (NEURON_EXTRACT_GRAPHS_ONLY=1) against the scratch cache: nothing published."""

    def make() -> Verdict:
        before, out = scan_modules(ctx.cache), ctx.scratch / "extract"
        args = ctx.recipe_args(1)
        ctx.cli("extract", "run", *args, "--output-dir", str(out), env={"NEURON_EXTRACT_GRAPHS_ONLY": "1"})
        published = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.stat().st_size)
        return verdicts.extraction_verdict(published, gained_neff(before, scan_modules(ctx.cache)))

    return ctx.once("extract", make)


def check_compile_once(ctx: DoctorContext) -> Verdict:
    _needs_runtime(ctx)
    parts = {"one worker": _compile_verdict(ctx, 1)}
    parts["extraction run"] = extracted(ctx)
    if ctx.nproc > 1:
        parts[f"{ctx.nproc} workers"] = _compile_verdict(ctx, ctx.nproc)
    return _combine(parts)


def _combine(parts: dict[str, Verdict]) -> Verdict:
    figures = {name: v.figures for name, v in parts.items()}
    for name, v in parts.items():
        if v.problem:
            return failed(f"{name}: {v.problem}", **figures)
    return passed(**figures)


# -- 3. collectives and data parallel --------------------------------------------------------------------------
def _needs_workers(ctx: DoctorContext, what: str) -> None:
    if ctx.nproc < 2:
        raise Skip(f"{what} needs --nproc-per-node 2 or more")


def check_collectives(ctx: DoctorContext) -> Verdict:
    _needs_workers(ctx, "the collectives check")
    report = ctx.scratch / "health.json"
    args = ["health", "--nproc-per-node", str(ctx.nproc), "--json", str(report), "--timeout", "120"]
    args += ["--backend", ctx.backend, "--work-dir", str(ctx.scratch / "health")]
    try:
        ctx.cli("health", *args)
    except StageFailed as exc:
        if not report.exists():
            raise
        result = read_json(report)
        return verdicts.health_verdict(result) if not result.get("ok") else failed(str(exc))
    return verdicts.health_verdict(read_json(report))


def check_data_parallel(ctx: DoctorContext) -> Verdict:
    _needs_workers(ctx, "data parallel")
    one, many = losses(trained(ctx, 1)), losses(trained(ctx, ctx.nproc))
    return verdicts.losses_verdict(f"{ctx.nproc} workers vs 1 on the same global batch", many, one)


# -- 5. checkpoint: save, kill, resume ---------------------------------------------------------------------------
def killed(ctx: DoctorContext) -> tuple[Path, int, bool]:
    """A run SIGKILLed once its first checkpoint is complete (or, when it ended first, with the later
    checkpoints removed, as a kill would have left it). (output dir, step it must resume from, killed)"""

    def make() -> tuple[Path, int, bool]:
        out = ctx.scratch / "killed"
        first = out / "checkpoints" / "step_00000002"
        proc = ctx.start("killed", "run", *ctx.recipe_args(1), "--output-dir", str(out))
        deadline = time.time() + 600
        while not (first / "COMPLETE").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        was_killed = proc.poll() is None
        if was_killed:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if not (first / "COMPLETE").exists():
            log = ctx.scratch / "logs" / "killed.log"
            raise StageFailed(f"the run to be killed wrote no checkpoint (exit {proc.returncode}, log: {log})")
        if not was_killed:
            for later in (out / "checkpoints").glob("step_*"):
                if later.name > first.name:
                    shutil.rmtree(later)
            for name in ("summary.json", "model"):
                shutil.rmtree(out / name, ignore_errors=True) if (out / name).is_dir() else (out / name).unlink(True)
        done = sorted(p.parent.name for p in (out / "checkpoints").glob("step_*/COMPLETE"))
        return out, int(done[-1].split("_")[1]), was_killed

    return ctx.once("killed", make)


def check_checkpoint(ctx: DoctorContext) -> Verdict:
    reference = trained(ctx, 1)
    out, step, was_killed = killed(ctx)
    ctx.cli("resumed", "run", *ctx.recipe_args(1), "--output-dir", str(out))
    resumed, plain = read_json(out / "summary.json"), read_json(reference / "summary.json")
    weights = "model/model.safetensors"
    same = (out / weights).read_bytes() == (reference / weights).read_bytes()
    verdict = verdicts.resume_verdict(
        resumed["resumed_from_step"], step, same, resumed["final_loss"] == plain["final_loss"]
    )
    verdict.figures["killed_mid_run"] = was_killed
    return verdict


# -- 4. memory-scaled training ----------------------------------------------------------------------------------
def check_zero1(ctx: DoctorContext) -> Verdict:
    _needs_workers(ctx, "ZeRO-1")
    if resolve_backend_name(ctx.backend) == "native":
        raise Skip("ZeRO-1 is a torch-xla path; the native backend shards with FSDP2")
    out = ctx.scratch / "zero1"
    args = ctx.recipe_args(ctx.nproc, "--set", "train.zero1=true", "--no-preflight")
    ctx.cli("zero1", "run", *args, "--output-dir", str(out))
    return verdicts.losses_verdict(
        f"ZeRO-1 vs data parallel at {ctx.nproc} workers", losses(out), losses(trained(ctx, ctx.nproc))
    )


def tensor_parallel_runs(ctx: DoctorContext) -> tuple[Path, Path]:
    """TP 2 through neuronx-distributed and one unsharded worker, both from the one-worker run's final weights
    (migrated to TP 2 shards for the sharded run)."""

    def make() -> tuple[Path, Path]:
        start = trained(ctx, 1) / "model"
        shards, tp1, tp2 = ctx.scratch / "tp-start", ctx.scratch / "tp-1", ctx.scratch / "tp-2"
        migrated(ctx, "tp-shard", start, shards, to="neuron", tp=2)
        # a tenth of the recipe's learning rate: AdamW turns float-rounding differences of near-zero gradients
        # into whole steps, so the sharded and unsharded weights drift apart with the rate (2.5e-4 after 6 steps
        # at 3e-3), while a shard in the wrong place is off by the weights' own size
        common = [str(ctx.recipe), "--set", f"runtime.compile_cache={ctx.cache}", "--no-preflight"]
        common += ["--set", "train.optimizer.lr=3.0e-4"]
        common += ["--set", f"data.batch_size={2 * PER_WORKER_BATCH}"] + (
            ["--backend", ctx.backend] if ctx.backend != "auto" else []
        )
        ctx.cli("tp-1", "run", *common, "--init-from", str(start), "--output-dir", str(tp1))
        tp_args = ["--nproc-per-node", "2", "--set", "parallel.tp=2", "--init-from", str(shards)]
        ctx.cli("tp-2", "run", *common, *tp_args, "--output-dir", str(tp2))
        return tp1, tp2

    return ctx.once("tensor-parallel", make)


def check_tensor_parallel(ctx: DoctorContext) -> Verdict:
    if resolve_backend_name(ctx.backend) == "native":
        raise Skip("tensor parallel through neuronx-distributed is a torch-xla path")
    if not ctx.has_module("neuronx_distributed"):
        raise Skip("neuronx-distributed not installed")
    tp1, tp2 = tensor_parallel_runs(ctx)
    trained_alike = verdicts.losses_verdict("TP 2 vs one unsharded worker", losses(tp2), losses(tp1))
    if trained_alike.problem:
        return trained_alike
    last = sorted((tp2 / "checkpoints").glob("step_*/COMPLETE"))[-1].parent
    verdict = verdicts.merge_verdict(merged_back(ctx, last, tp1 / "model"))
    verdict.figures.update(trained_alike.figures)
    return verdict


def merged_back(ctx: DoctorContext, shards: Path, reference: Path) -> dict:
    """`checkpoint migrate --to gpu` of the TP run's last checkpoint, then `checkpoint verify --logits` of it
    against the unsharded run."""
    merged = ctx.scratch / "tp-merged"
    migrated(ctx, "tp-merge", shards, merged, to="gpu")
    try:
        result = verify(merged, reference, atol=1e-3, logits=ctx.recipe)
    except Exception as exc:  # the command's own failure is the check's verdict, as a stage's exit would be
        raise StageFailed(f"`neurontrain checkpoint verify` (tp-verify) failed: {exc!r}") from exc
    (ctx.scratch / "logs" / "tp-verify.json").write_text(json.dumps(result, indent=2))
    return result


def migrated(ctx: DoctorContext, stage: str, src: Path, dest: Path, **options: object) -> dict:
    """`neurontrain checkpoint migrate SRC DEST --overwrite` in this process: torch is loaded here already, and
    a process of its own would load it again for a conversion of a second."""
    try:
        report = migrate(src, dest, MigrateOptions(overwrite=True, **options))
    except Exception as exc:
        raise StageFailed(f"`neurontrain checkpoint migrate` ({stage}) failed: {exc!r}") from exc
    (ctx.scratch / "logs" / f"{stage}.json").write_text(json.dumps(report, indent=2))
    return report


# -- 6. native -------------------------------------------------------------------------------------------------
def check_native(ctx: DoctorContext) -> Verdict:
    if resolve_backend_name(ctx.backend) != "native" and not (torchneuron_host() and neuron_devices()):
        raise Skip("not a TorchNeuron host (run with --backend native to check torch.compile here)")
    native, eager = ctx.scratch / "native", ctx.scratch / "eager"
    common = [
        str(ctx.recipe),
        "--set",
        f"runtime.compile_cache={ctx.cache}",
        "--no-preflight",
        "--set",
        "checkpoint.every=0",
    ]
    ctx.cli("native", "run", *common, "--backend", "native", "--output-dir", str(native))
    ctx.cli("eager", "run", *common, "--backend", "eager", "--output-dir", str(eager))
    summary = read_json(native / "summary.json")
    alike = verdicts.losses_verdict("native vs eager", losses(native), losses(eager))
    return verdicts.native_verdict(alike, summary["compilations"], summary["expected_graphs"])


def check_native_compile_once(ctx: DoctorContext) -> Verdict:
    """precompile --backend native for the doctor's workers, then their run on a fresh node (a local cache holding
    precompile's entry only: no NEFF directory, no compiler cache of this layout)."""
    if resolve_backend_name(ctx.backend) != "native" and not (torchneuron_host() and neuron_devices()):
        raise Skip("not a TorchNeuron host (run with --backend native to check torch.compile here)")
    _needs_workers(ctx, "the multi-worker native compile-once check")
    store, node, report = ctx.scratch / "native-store", ctx.scratch / "native-node", ctx.scratch / "native-pre.json"
    common = [str(ctx.recipe), "--backend", "native", "--nproc-per-node", str(ctx.nproc), "--set", "checkpoint.every=0"]
    ctx.cli("native-precompile", "precompile", *common, "--cache", str(store), "--json", str(report))
    shutil.copytree(store / "native", node / "native")
    out = ctx.scratch / "native-workers"
    ctx.cli("native-workers", "run", *common, "--no-preflight", "--set", f"runtime.compile_cache={node}", "-o",
            str(out))  # fmt: skip
    return verdicts.native_compile_once_verdict(read_json(report), read_json(out / "summary.json"))


CHECKS = (
    Check("environment", check_environment, quick=True),
    Check("compile-once", check_compile_once, quick=True),
    Check("collectives", check_collectives, quick=True),
    Check("data-parallel", check_data_parallel, quick=True),
    Check("checkpoint", check_checkpoint, quick=True),
    Check("zero1", check_zero1, quick=False),
    Check("tensor-parallel", check_tensor_parallel, quick=False),
    Check("native", check_native, quick=False),
    Check("native-compile-once", check_native_compile_once, quick=False),
)
