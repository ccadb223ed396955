"""`neurontrain checkpoint verify A B`: tensor-by-tensor comparison of two checkpoints in any supported format,
and optionally the two models' logits on the same sample input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from neurontrain.checkpoint.formats import TensorSource
from neurontrain.checkpoint.matching import MappedSource, model_from_config
from neurontrain.checkpoint.nxd import NxdReader
from neurontrain.checkpoint.opening import open_checkpoint
from neurontrain.checkpoint.optimum_neuron import OptimumNeuronReader
from neurontrain.errors import UsageError
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe

DIFF_CHUNK_ELEMENTS = 1 << 24


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| (NaN if either holds a NaN where the other differs), in float64 over chunks of 16 M
    elements: a 70B model's embedding in float64 whole would take 8 GB per copy."""
    if a.dtype == b.dtype and torch.equal(a, b):
        return 0.0
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    worst = 0.0
    for start in range(0, flat_a.numel(), DIFF_CHUNK_ELEMENTS):
        stop = start + DIFF_CHUNK_ELEMENTS
        diff = (flat_a[start:stop].double() - flat_b[start:stop].double()).abs().max().item()
        if math.isnan(diff):
            return diff
        worst = max(worst, diff)
    return worst


def compare(a: TensorSource, b: TensorSource, atol: float = 0.0) -> dict:
    keys_a, keys_b = set(a.keys()), set(b.keys())
    rows, worst = [], 0.0
    for name in sorted(keys_a & keys_b):
        ta, tb = a.get(name), b.get(name)
        row = {
            "name": name,
            "shape_a": list(ta.shape),
            "shape_b": list(tb.shape),
            "dtype_a": str(ta.dtype).split(".")[-1],
            "dtype_b": str(tb.dtype).split(".")[-1],
        }
        if ta.shape != tb.shape:
            row["status"] = "shape differs"
        else:
            diff = max_abs_diff(ta, tb)
            row["max_abs_diff"] = diff
            worst = max(worst, diff)
            row["status"] = (
                "identical"
                if diff == 0 and ta.dtype == tb.dtype
                else "dtype differs"
                if ta.dtype != tb.dtype and diff <= atol
                else "within tolerance"
                if diff <= atol
                else "differs"
            )
        rows.append(row)
    ok_states = {"identical", "within tolerance", "dtype differs"} if atol > 0 else {"identical"}
    return {
        "a": a.description,
        "b": b.description,
        "tensors": len(rows),
        "missing_in_b": sorted(keys_a - keys_b),
        "extra_in_b": sorted(keys_b - keys_a),
        "max_abs_diff": worst,
        "differing": [r for r in rows if r["status"] not in ok_states],
        "equal": not (keys_a ^ keys_b) and all(r["status"] in ok_states for r in rows),
    }


def logits_diff(a: TensorSource, b: TensorSource, config: dict, seed: int = 0) -> float:
    """Max abs difference of the two models' outputs (fp32, eval mode) on a seeded random batch."""
    outputs = []
    torch.manual_seed(seed)
    ids = torch.randint(0, config.get("vocab_size", 100), (2, 16))
    for source in (a, b):
        model = model_from_config(config).float().eval()
        state = {n: source.get(n).float() for n in source.keys()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if config.get("tie_word_embeddings", True) else set()
        real_missing = [m for m in missing if m not in tied]
        if real_missing or unexpected:
            raise ValueError(
                f"{source.description} does not fit the model: missing {real_missing[:3]}, unexpected {unexpected[:3]}"
            )
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        with torch.no_grad():
            out = model(input_ids=ids)
        outputs.append(out.logits if hasattr(out, "logits") else out.last_hidden_state)
    return (outputs[0] - outputs[1]).abs().max().item()


def verify(
    path_a: Path, path_b: Path, atol: float = 0.0, config: Path | None = None, logits: Path | None = None
) -> dict:
    """`checkpoint verify`: the two checkpoints compared tensor by tensor and, with `logits` (a recipe, config
    directory or config.json), the model's outputs on a sample input under each; "equal" when both agree."""
    a, b, model_config = open_pair(path_a, path_b, config, logits)
    result = compare(a, b, atol)
    if logits:
        result["logits_max_abs_diff"] = logits_diff(a, b, model_config)
        result["equal"] = result["equal"] and result["logits_max_abs_diff"] <= max(atol, 1e-5)
    return result


def open_pair(
    path_a: Path, path_b: Path, config: Path | None, logits: Path | None
) -> tuple[TensorSource, TensorSource, dict | None]:
    """Both checkpoints under the model's names (each matched against the config of either side, --config or
    the --logits config), or under the names found when no config is known; and that config."""
    a, b = open_checkpoint(path_a, config), open_checkpoint(path_b, config)
    shared = config_for_logits(logits, a, b) if logits else a.config or b.config
    if shared is None:
        return a, b, None
    named = (NxdReader, OptimumNeuronReader)  # Hugging Face names already
    mapped = [s if isinstance(s, named) else MappedSource(s, s.config or shared) for s in (a, b)]
    return mapped[0], mapped[1], shared


def config_for_logits(path: Path, a: TensorSource, b: TensorSource) -> dict:
    if path.is_dir():
        path = path / "config.json"
    if path.suffix in (".yaml", ".yml"):
        return make_plan(load_recipe(path, []), "eager").config.to_dict()
    if path.is_file():
        return json.loads(path.read_text())
    config = a.config or b.config
    if config is None:
        raise UsageError(f"--logits {path}: not a recipe, config directory or config.json")
    return config
