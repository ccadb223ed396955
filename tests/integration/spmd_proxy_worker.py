"""Runs of the SPMD proxy, in one process per mode: each job is a shipped tiny recipe's model trained a few
AdamW steps on a fixed random batch, either unsharded (`plain`) or sharded over CPU_NUM_DEVICES virtual devices
by the migrate rules (`sharded`). Prints one JSON line per job: losses, each parameter's (and gradient's)
sharding spec as torch-xla reports it, and the parameters whose per-device pieces differ from `rules.shard`.

A job `RECIPE@NAME=RULE[,NAME=RULE...]` annotates each parameter NAME by RULE instead of its own rule (to show the
check can fail)."""

import argparse
import json
import sys

import torch

from neurontrain.model.build import build_config, build_model
from neurontrain.parallel import spmd
from neurontrain.parallel.tensor_parallel import model_spec
from neurontrain.recipe import load_recipe

SETTINGS = ["model.config.vocab_size=256", "train.activation_checkpointing=none", "runtime.backend=xla-cpu"]
# No dropout (the sharded and unsharded runs draw differently); tiny BERT's 2 heads become 4 to split 4 ways.
FAMILY_SETTINGS = {
    "llama": ["model.config.attention_dropout=0.0"],
    "bert": [
        "model.config.hidden_dropout_prob=0.0",
        "model.config.attention_probs_dropout_prob=0.0",
        "model.config.num_attention_heads=4",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["plain", "sharded"])
    parser.add_argument("jobs", nargs="+")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.mode == "sharded":
        spmd.use_spmd()  # before anything creates the device
    for job in args.jobs:
        recipe, _, corrupt = job.partition("@")
        print(json.dumps(train(recipe, args.mode == "sharded", args.tp, args.steps, corrupt or None)), flush=True)


def train(path: str, sharded: bool, tp: int, steps: int, corrupt: str | None) -> dict:
    import torch_xla

    recipe = load_recipe(path, SETTINGS)
    recipe = load_recipe(path, SETTINGS + FAMILY_SETTINGS[recipe.model.config["model_type"]])
    model = build_model(recipe, build_config(recipe, None))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (4, 32), generator=generator)
    labels = ids if recipe.task == "causal-lm" else torch.randint(0, 2, (4,), generator=generator)
    device = torch_xla.device()
    model.to(device)
    ids, labels = ids.to(device), labels.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.train.optimizer.lr)
    spec = model_spec(model, tp)
    mesh = spmd.make_mesh(spec) if sharded else None
    losses = []
    for step in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if mesh is not None:
            _mark(model, mesh, spec, optimizer, corrupt)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if mesh is not None and step == 0:
            _mark(model, mesh, spec, optimizer, corrupt)  # the optimizer state exists now
        torch_xla.sync()
        losses.append(loss.item())
    report = {"losses": losses}
    if mesh is not None:
        report["specs"] = {n: torch_xla._XLAC._get_xla_sharding_spec(p) for n, p in model.named_parameters()}
        report["grad_specs"] = {n: torch_xla._XLAC._get_xla_sharding_spec(p.grad) for n, p in model.named_parameters()}
        whole = {name: p.detach().cpu() for name, p in model.named_parameters()}  # gathered from the devices
        report["mismatches"] = spmd.placement_mismatches(model, spec, whole)
    return report


def _mark(model, mesh, spec, optimizer, corrupt: str | None) -> None:
    table = spec.table  # the spec's stored rules (a list, changed in place here and restored)
    saved = list(table)
    for wrong in corrupt.split(",") if corrupt else []:  # this process only: each named parameter's wrong rule
        name, rule = wrong.split("=")
        table.insert(0, [f"^{name}$", rule])
    try:
        spmd.mark_model(model, mesh, spec, optimizer)
    finally:
        table[:] = saved


if __name__ == "__main__":
    sys.exit(main())
