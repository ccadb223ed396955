"""Every model family of tests/families.py trained as `run` trains it, in one fresh process (imports and the XLA
runtime paid once; tests/integration/test_families.py reads what it prints).

For each family: the shipped tiny recipe of its task (tiny-llama-clm or tiny-bert-classification) with the
family's tiny config, trained a few steps on XLA:CPU unpacked and with data.packing on (a refusal is recorded as
its one line); then the exported model migrated to TP 2 NxD shards and a run started from those shards
(`run --init-from`) at a learning rate that moves nothing, whose exported weights must equal the first run's.
Graphs compiled by an earlier run of the same process are not compiled again (XLA's in-process cache), so a
run's compilations can be below its planned graphs; the guard still checks every graph against the plan.
Prints one JSON line per family. `nan-run`: `neurontrain run` at a learning rate that makes the loss NaN.

Usage: python family_runs_worker.py OUT_DIR MODEL_TYPE [MODEL_TYPE ...] [nan-run]
"""

import json
import sys
import time
from pathlib import Path

import torch
import yaml
from families import BY_TYPE, CLM, tiny_config_values
from safetensors.torch import load_file

from neurontrain.checkpoint.initial import InitialCheckpoint
from neurontrain.cli import main as cli
from neurontrain.errors import NeurontrainError, first_line
from neurontrain.launch.run import train_single
from neurontrain.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
SHORT = {
    "data": {"train_samples": 240, "eval_samples": 16, "max_length": 64, "buckets": [64], "packing": "off"},
    # 15 steps: every language model's last 5 losses end >= 10% below its first 5 (Gemma 2 and 3 the least);
    # the 15 steps more that 30 took cost ~20 s of the family runs' 200 (the 73 XLA compiles: ~120 s)
    "train": {"max_steps": 15, "log_every": 1, "eval_at_end": True, "schedule": {"warmup_steps": 1}},
    "checkpoint": {"every": 0},
    "runtime": {"preflight": False},
}


def _merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def _recipe(out: Path, model_type: str, name: str, changes: dict):
    family = BY_TYPE[model_type]
    base = "tiny-llama-clm.yaml" if family.task == CLM else "tiny-bert-classification.yaml"
    raw = yaml.safe_load((REPO / "recipes" / base).read_text())
    raw["model"]["config"] = tiny_config_values(model_type)
    if family.task != CLM:  # the tiny classifiers need more steps than the language models to leave ln 2
        changes = _merge({"train": {"max_steps": 60}}, changes)
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_merge(_merge(raw, SHORT), changes)))
    return load_recipe(path)


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _train(out: Path, model_type: str, name: str, changes: dict, init_from: Path | None = None) -> dict:
    run_dir = out / name
    started = time.perf_counter()
    try:
        recipe = _recipe(out, model_type, name, changes)
        initial = InitialCheckpoint(init_from, weights_only=True) if init_from is not None else None
        summary = train_single(recipe, run_dir, preflight_check=False, init_from=initial)
    except NeurontrainError as exc:
        return {"error": first_line(exc, 400), "exit_code": exc.exit_code}
    except Exception as exc:  # a crash is a result here: the test names the family and the line
        return {"error": f"{type(exc).__name__}: {first_line(exc, 400)}", "exit_code": None}
    return {
        "losses": _losses(run_dir),
        "eval_loss": summary.eval_loss,
        "compilations": summary.compilations,
        "expected_graphs": summary.expected_graphs,
        "unexpected_graphs": summary.unexpected_graphs,
        "padding_fraction": summary.padding_fraction,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _tensors(run_dir: Path) -> dict:
    return load_file(str(run_dir / "model" / "model.safetensors"))


def _from_shards(out: Path, model_type: str) -> dict:
    """TP 2 shards of the unpacked run's model, then a run started from them at learning rate ~0 (eager: the
    loading is the point) whose exported weights must be the unpacked run's, bit for bit."""
    shards = out / "tp2"
    code = cli(["checkpoint", "migrate", str(out / "unpacked" / "model"), str(shards), "--to", "neuron", "--tp", "2"])
    if code != 0:
        return {"error": f"migrate --to neuron --tp 2 exited {code}"}
    # a learning rate too small to move any fp32 weight (recipes refuse 0)
    changes = {"train": {"max_steps": 1, "optimizer": {"lr": 1e-30, "weight_decay": 0.0}, "eval_at_end": False}}
    changes["train"]["schedule"] = {"warmup_steps": 0}
    changes["runtime"] = {"backend": "eager", "preflight": False}
    result = _train(out, model_type, "from_shards", changes, init_from=shards)
    if "error" in result:
        return result
    before, after = _tensors(out / "unpacked"), _tensors(out / "from_shards")
    # one step at lr 1e-30 moves a weight by at most ~1e-30 (an exact zero becomes a denormal): far below any
    # difference a wrong load makes (weights of order 0.02)
    differing = sorted(
        k for k in before if k not in after or not torch.allclose(before[k], after[k], rtol=0, atol=1e-28)
    )
    return {"equal": not differing and before.keys() == after.keys(), "differing": differing[:3]}


def _nan_run(out: Path) -> dict:
    """`neurontrain run` of tiny BERT at learning rate 1e8 (its loss is NaN at step 2, at XLA:CPU's optimization
    levels 0 to 2; at 1e6 level 0 made the weights infinite a step before the loss): the exit code,
    the step losses and what the run left in its output directory."""
    steps = ["train.max_steps=8", "train.log_every=1", "checkpoint.every=1", "train.schedule.warmup_steps=1"]
    overrides = [*steps, "train.optimizer.lr=1e8", "data.train_samples=256", "data.max_length=64"]
    recipe = str(REPO / "recipes" / "tiny-bert-classification.yaml")
    sets = [a for o in overrides for a in ("--set", o)]
    code = cli(["run", recipe, "--output-dir", str(out), "--no-preflight", *sets])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "exit_code": code,
        "losses": {r["step"]: r["loss"] for r in rows if "loss" in r},
        "checkpoints": sorted(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").iterdir()),
        "left": sorted(p.name for p in out.iterdir()),
    }


def main() -> None:
    out_root = Path(sys.argv[1])
    for model_type in sys.argv[2:]:
        if model_type == "nan-run":
            print(json.dumps({"model_type": "nan-run", **_nan_run(out_root / "nan-run")}), flush=True)
            continue
        out = out_root / model_type
        out.mkdir(parents=True, exist_ok=True)
        report = {"model_type": model_type, "unpacked": _train(out, model_type, "unpacked", {})}
        report["packed"] = _train(out, model_type, "packed", {"data": {"packing": "on"}})
        if "error" not in report["unpacked"]:
            report["from_tp2_shards"] = _from_shards(out, model_type)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
