"""Pass or fail from what a check measured: pure functions over dicts and lists (no torch, no processes)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from neurontrain.compile.runtime_cache import expected_flags_hash, module_flags_hash
from neurontrain.doctor.report import Verdict, failed, passed

# Neuron devices (/dev/neuron*) an instance type shows: trn1 16 Trainium devices (trn1.2xlarge one), trn2 16
EXPECTED_DEVICES = {"trn1.2xlarge": 1, "trn1.32xlarge": 16, "trn1n.32xlarge": 16, "trn2.48xlarge": 16}
LOSS_TOLERANCE = 1e-5  # relative, per logged step


def environment_verdict(facts: Mapping) -> Verdict:
    """facts: product (instance type or None), devices (list), backend (what auto picks), runtime (bool),
    cache_root / cache_writable, compiler (compiler_view or None)."""
    product, devices = facts.get("product") or "", facts["devices"]
    expected = EXPECTED_DEVICES.get(product)
    figures = {**facts, "devices_seen": len(devices), "devices_expected": expected}
    figures.pop("devices")
    if expected is not None and len(devices) != expected:
        return failed(
            f"{product} shows {len(devices)} Neuron devices, expected {expected}: driver or visibility", **figures
        )
    if product.startswith("trn") and facts["backend"] != "neuron":
        return failed(
            f"on {product} the auto backend picks {facts['backend']}: torch-neuronx or /dev/neuron* missing", **figures
        )
    if facts["runtime"] and not facts["compiler"].get("compiler_version_dir"):
        return failed("the Neuron runtime is installed but neuronx-cc is not on PATH: nothing can compile", **figures)
    if facts.get("cache_writable") is False:
        return failed(f"the runtime's cache {facts['cache_root']} is not writable: every run compiles again", **figures)
    return passed(**figures)


def flags_difference(before: list[str], after: list[str]) -> str:
    """What `after` adds to and drops from `before`, counting repeats (the runtime hashes the whole list)."""
    added, dropped = Counter(after) - Counter(before), Counter(before) - Counter(after)
    parts = [f"adds {' '.join(added.elements())}"] if added else []
    parts += [f"drops {' '.join(dropped.elements())}"] if dropped else []
    return ", ".join(parts) or "same flags in another order"


def compile_once_verdict(
    workers: int,
    manifest: list[str],
    states_before_run: Mapping[str, str],
    states_after_run: Mapping[str, str],
    summary: Mapping,
    flags_of: Mapping[str, list[str]],
    predicted_flags: list[str] | None = None,
) -> Verdict:
    """manifest: the module directories precompile recorded; states_before_run / states_after_run: every module
    directory in the scratch cache (name -> state) around the run; summary: the run's summary.json; flags_of:
    each module's compile_flags.json as the runtime wrote it; predicted_flags: the flags `env` and the
    environment check say the runtime will use (None where the target is unknown)."""
    new = sorted(set(states_after_run) - set(states_before_run))
    neuron = summary.get("neuron_cache") or {}
    figures = {
        "workers": workers,
        "manifest_modules": len(manifest),
        "modules_new_at_run": len(new),
        "compiled_at_run_time": neuron.get("compiled_at_run_time"),
        "cache_hits": neuron.get("cache_hits"),
        "unexpected_graphs": summary.get("unexpected_graphs"),
        "flags_hash": sorted({module_flags_hash(m) for m in manifest}),
    }
    uncompiled = [m for m in manifest if states_after_run.get(m) != "compiled"]
    if not manifest:
        problem = "precompile recorded no runtime modules: the runtime wrote nothing in extraction mode"
    elif uncompiled:
        problem = f"{len(uncompiled)} precompiled modules have no NEFF ({uncompiled[0]}): the compile phase failed"
    elif new:
        problem = _new_modules_problem(manifest, new, flags_of)
    elif predicted_flags is not None and _predicted_problem(manifest, flags_of, predicted_flags):
        problem = _predicted_problem(manifest, flags_of, predicted_flags)
    elif neuron.get("compiled_at_run_time"):
        problem = f"the runtime compiled {neuron['compiled_at_run_time']} modules at run time"
    elif summary.get("unexpected_graphs"):
        problem = f"the run traced {summary['unexpected_graphs']} graphs precompile did not"
    else:
        return passed(**figures)
    return failed(problem, **figures)


def _new_modules_problem(manifest: list[str], new: list[str], flags_of: Mapping[str, list[str]]) -> str:
    old_hashes = {module_flags_hash(m) for m in manifest}
    moved = [m for m in new if module_flags_hash(m) not in old_hashes]
    if moved:
        pre, run = flags_of.get(manifest[0], []), flags_of.get(moved[0], [])
        return (
            f"the run's modules carry flags hash {module_flags_hash(moved[0])}, precompile's "
            f"{module_flags_hash(manifest[0])} (the run {flags_difference(pre, run)}): the runtime got other "
            "compiler flags at run time than at precompile"
        )
    return (
        f"the runtime named {len(new)} modules at run time that precompile never saw (same flags, other keys, "
        f"e.g. {new[0]}): its module names differ between extraction and execution"
    )


def _predicted_problem(manifest: list[str], flags_of: Mapping[str, list[str]], predicted: list[str]) -> str | None:
    expected = expected_flags_hash(predicted)
    other = [m for m in manifest if module_flags_hash(m) != expected]
    if not other:
        return None
    written = flags_of.get(other[0], [])
    return (
        f"the runtime hashed {module_flags_hash(other[0])} for flags {written}, the toolkit predicts {expected} "
        f"for {predicted} ({flags_difference(predicted, written)}): `env` and cache names disagree"
    )


def extraction_verdict(published: list[str], neff_gained: list[str]) -> Verdict:
    """published: what an extraction-mode run left in its output directory (files); neff_gained: modules it
    compiled."""
    figures = {"files_published": len(published), "modules_compiled": len(neff_gained)}
    if published:
        return failed(f"an extraction-mode run published {published[0]} (its values are fake)", **figures)
    if neff_gained:
        return failed(f"an extraction-mode run compiled {len(neff_gained)} modules (it must only extract)", **figures)
    return passed(**figures)


def worst_relative(a: Mapping[int, float], b: Mapping[int, float]) -> float:
    return max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-12) for s in b)


def losses_verdict(
    what: str, a: Mapping[int, float], b: Mapping[int, float], tolerance: float = LOSS_TOLERANCE
) -> Verdict:
    """Two runs' losses by step agree within `tolerance` (relative) on every step."""
    if not b or sorted(a) != sorted(b):
        return failed(f"{what}: the runs logged different steps ({sorted(a)[:5]} vs {sorted(b)[:5]})", steps=len(b))
    worst = worst_relative(a, b)
    step = max(b, key=lambda s: abs(a[s] - b[s]) / max(abs(b[s]), 1e-12))
    figures = {"steps": len(b), "worst_relative_loss_difference": float(f"{worst:.3g}"), "tolerance": tolerance}
    if not worst <= tolerance:
        return failed(f"{what}: loss differs by {worst:.2e} (relative) at step {step}, over {tolerance:g}", **figures)
    return passed(**figures)


def health_verdict(result: Mapping) -> Verdict:
    figures = {"workers": result.get("world_size"), "ok": result.get("ok")}
    if result.get("ok"):
        return passed(**figures)
    bad = (result.get("bad_ranks") or [{}])[0]
    return failed(
        f"collectives: rank {bad.get('rank', '?')}: {bad.get('problem', 'below the busbw threshold')} "
        f"({bad.get('check', '-')})",
        **figures,
    )


def resume_verdict(resumed_from: int | None, expected_from: int, same_weights: bool, same_loss: bool) -> Verdict:
    figures = {"resumed_from_step": resumed_from, "weights_bit_identical": same_weights, "final_loss_equal": same_loss}
    if resumed_from != expected_from:
        return failed(
            f"the restarted run resumed from {resumed_from}, not the checkpoint of step {expected_from}", **figures
        )
    if not same_weights or not same_loss:
        return failed(
            "the resumed run ends with other weights than the uninterrupted run: the checkpoint does not restore "
            "the whole state",
            **figures,
        )
    return passed(**figures)


def merge_verdict(verify: Mapping) -> Verdict:
    """`checkpoint verify --logits --json` of the TP run migrated to Hugging Face against the unsharded run."""
    figures = {
        "max_abs_diff": verify.get("max_abs_diff"),
        "logits_max_abs_diff": verify.get("logits_max_abs_diff"),
        "tensors": verify.get("tensors"),
    }
    if not verify.get("equal"):
        return failed(
            "the TP 2 checkpoint migrated to Hugging Face differs from the unsharded run "
            f"(logits max abs diff {verify.get('logits_max_abs_diff')}): the shards do not merge back",
            **figures,
        )
    return passed(**figures)


def native_verdict(losses: Verdict, compilations: int, expected_graphs: int) -> Verdict:
    figures = {**losses.figures, "compilations": compilations, "expected_graphs": expected_graphs}
    if losses.problem:
        return failed(losses.problem, **figures)
    if compilations > expected_graphs:
        return failed(
            f"torch.compile compiled {compilations} graphs for {expected_graphs} planned: it recompiles", **figures
        )
    return passed(**figures)


def native_compile_once_verdict(report: Mapping, summary: Mapping) -> Verdict:
    """The multi-worker native compile-once check: precompile compiled each graph once for the layout, and every
    worker of the run on a fresh node loaded the entry and compiled nothing (TorchNeuron: no NEFF appeared; else
    no AOTAutograd cache miss)."""
    workers = summary.get("compile_cache", {}).get("native", {}).get("workers", [])
    figures = {
        "workers": len(workers),
        "precompile_ranks": sorted(int(r) for r in report.get("ranks_compiled", {})),
        "compiled_per_worker": [_native_compiled(w) for w in workers],
    }
    if len(workers) != report.get("workers"):
        return failed(f"{len(workers)} workers reported their cache use, of {report.get('workers')}", **figures)
    not_loaded = [w["rank"] for w in workers if not w.get("loaded")]
    if not_loaded:
        refused = {w["rank"]: w.get("refused") for w in workers if w.get("refused")}
        return failed(f"workers {not_loaded} did not load precompile's entry {refused or ''}".strip(), **figures)
    compiled = {w["rank"]: _native_compiled(w) for w in workers if _native_compiled(w)}
    if compiled:
        return failed(f"workers compiled at run time although precompile's entry loaded: {compiled}", **figures)
    return passed(**figures)


def _native_compiled(worker: Mapping) -> int:
    neffs = worker.get("neff_cache")
    return int(neffs["compiled"]) if neffs is not None else int(worker.get("graphs_compiled", 0))
