"""Toolkit loop vs a minimal hand-written torch-xla loop: same model, same batches, same optimizer, clipping
and schedule, on XLA:CPU. Prints one JSON object.

    python benchmarks/loop_overhead.py [--steps 200] [--rounds 5]

The recipe's own data defaults (packed rows where the planner packs), so the figure follows a default change; the
hand loop takes the same collated batches and runs the same forward (a packed classifier's per-document head
included). Both loops read the loss in a step closure every --log-every steps and time the intervals between those
closures; intervals up to the first --log-every steps (compiles) are left out. overhead = 1 - toolkit / hand
throughput (median over rounds; the two loops alternate so machine noise hits both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-bert-classification.yaml"


def overrides(steps: int, log_every: int) -> list[str]:
    warmup = [f"train.schedule.warmup_steps={steps // 2}"] if steps <= 10 else []  # a smoke run's few steps
    return [
        f"train.max_steps={steps}",
        f"train.log_every={log_every}",
        "checkpoint.every=0",
        "checkpoint.save_final=false",
        "train.eval_at_end=false",
        "data.eval_samples=0",
        *warmup,
    ]


def hand_loop(steps: int, log_every: int) -> float:
    """The loop a torch-xla user writes by hand, fed the toolkit's batches. Returns steady-state tokens/s."""
    import os

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import itertools

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl

    from neurontrain.loop.optim import build_optimizer, build_scheduler
    from neurontrain.model.build import build_model, model_inputs
    from neurontrain.model.packed import packed_classification
    from neurontrain.plan.planning import make_plan
    from neurontrain.recipe import load_recipe

    recipe = load_recipe(RECIPE, overrides(steps, log_every))
    plan = make_plan(recipe, "xla-cpu")
    device = torch_xla.device()
    model = build_model(recipe, plan.config).to(device)
    optimizer = build_optimizer(recipe, model)
    scheduler = build_scheduler(recipe, optimizer)
    collate = plan.collator("train", 0)
    batches = [collate(b) for b in itertools.islice(plan.batcher.iterate(0), steps)]
    real_tokens = [b.pop("real_tokens") for b in batches]
    for b in batches:
        b.pop("loss_items")
    offset = plan.dims.inputs.position_offset
    marks: list[tuple[int, float]] = []

    def mark(step: int, loss: torch.Tensor) -> None:
        loss.item()
        marks.append((step, time.perf_counter()))

    for step, batch in enumerate(pl.MpDeviceLoader(batches, device), start=1):
        if "cls_positions" in batch:  # packed rows of a classifier: one prediction per document
            loss = packed_classification(model, batch, torch.float32, offset).loss
        else:
            loss = model(**model_inputs(batch, plan.dims, torch.float32)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.train.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step % log_every == 0:
            xm.add_step_closure(mark, args=(step, loss.detach()))
        torch_xla.sync()
    (s0, t0), (s1, t1) = marks[0], marks[-1]
    return sum(real_tokens[s0:s1]) / (t1 - t0)


def toolkit_loop(steps: int, log_every: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "neurontrain", "run", str(RECIPE), "--output-dir", tmp]
        for item in overrides(steps, log_every):
            cmd += ["--set", item]
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(result.stderr[-2000:])
        records = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "loss" in r and r["step"] > log_every and r["step"] % log_every == 0]
    return statistics.mean(r["tokens_per_second"] for r in steady)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hand", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hand:
        print(json.dumps({"tokens_per_second": hand_loop(args.steps, args.log_every)}))
        return
    hand, toolkit = [], []
    for _ in range(args.rounds):
        res = subprocess.run(
            [sys.executable, __file__, "--hand", "--steps", str(args.steps), "--log-every", str(args.log_every)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            raise SystemExit(res.stderr[-2000:])
        hand.append(json.loads(res.stdout.strip().splitlines()[-1])["tokens_per_second"])
        toolkit.append(toolkit_loop(args.steps, args.log_every))
    ratio = statistics.median(toolkit) / statistics.median(hand)
    print(
        json.dumps(
            {
                "steps": args.steps,
                "hand_tokens_per_second": [round(x, 1) for x in hand],
                "toolkit_tokens_per_second": [round(x, 1) for x in toolkit],
                "toolkit_vs_hand_throughput": round(ratio, 4),
                "overhead": round(1 - ratio, 4),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
