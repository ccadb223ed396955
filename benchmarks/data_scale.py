"""Data at scale: the tokenized store against Hugging Face `datasets` `map` + a Trainer-style loader, on the same
generated corpus (tiny-llama-clm's text, the same word-level tokenizer), at several sizes. Prints one JSON object.

    python benchmarks/data_scale.py [--sizes 10000,100000,1000000]

Per size, each in a fresh process:
- tokenize seconds, first (empty cache) and cached: neurontrain's `prepare_data` (tokenized store) against
  `Dataset.from_generator` + `map(tokenize, batched=True, num_proc=2)` (its Arrow cache);
- plan seconds: neurontrain's `make_plan` on the prepared data (packing, buckets, the planned batches; the second
  of two, so the model's imports are not counted) against the
  seconds to a Trainer-style loader's first batch (`DataLoader` with shuffle and `DataCollatorForLanguageModeling`);
- peak RSS of every process of a 3-step training run at 1 and 2 workers: `neurontrain run --backend eager
  [--nproc-per-node 2]` (the launcher and its workers) against `torchrun` workers that load the mapped dataset, shard
  it with a `DistributedSampler` and train the same model 3 steps. Sampled every 0.1 s with psutil.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-llama-clm.yaml"
EVAL = 32


def _overrides(n: int) -> list[str]:
    return [
        f"data.train_samples={n}",
        f"data.eval_samples={EVAL}",
        "data.packing=on",
        "train.max_steps=3",
        "train.schedule.warmup_steps=1",
    ]


def _peaks(command: list[str], env: dict) -> dict:
    """Run `command`; the peak RSS (GB) of its root process and of each descendant Python process."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, float] = {}
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                for p in [root, *root.children(recursive=True)]:
                    peaks[p.pid] = max(peaks.get(p.pid, 0.0), p.memory_info().rss / 1e9)
            except psutil.Error:
                pass
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"{command[:4]} exited {proc.returncode}: {err[-2000:]}")
    others = sorted((v for pid, v in peaks.items() if pid != proc.pid and v > 0.2), reverse=True)
    return {"root_gb": round(peaks.get(proc.pid, 0.0), 3), "workers_gb": [round(v, 3) for v in others], "out": out}


def _child_json(args: list[str], env: dict) -> dict:
    result = _peaks([sys.executable, __file__, *args], env)
    return json.loads(result["out"].strip().splitlines()[-1]) | {"rss_gb": result["root_gb"]}


def child_ours(n: int) -> None:
    from neurontrain.data.sources import prepare_data
    from neurontrain.plan.planning import make_plan
    from neurontrain.recipe import load_recipe

    recipe = load_recipe(RECIPE, _overrides(n))
    started = time.perf_counter()
    data = prepare_data(recipe)
    prepared = time.perf_counter()
    make_plan(recipe, "eager", data)  # imports the model's modules; the second plan is timed
    replanned = time.perf_counter()
    make_plan(recipe, "eager", data)
    planned = time.perf_counter()
    out = {"tokenize_s": round(prepared - started, 2), "plan_s": round(planned - replanned, 2)}
    print(json.dumps(out | {"store": data.store["path"], "tokenized": data.store["tokenized_documents"]}))


def _hf_dataset(n: int, tokenizer_file: str):
    import datasets
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from neurontrain.data.synthetic import iter_story_text

    datasets.disable_progress_bars()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(Path(tokenizer_file).read_text()),
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )
    raw = datasets.Dataset.from_generator(iter_story_text, gen_kwargs={"n": n, "seed": 0})
    mapped = raw.map(
        lambda batch: tok(batch["text"], truncation=True, max_length=128),
        batched=True,
        num_proc=2,
        remove_columns=["text"],
    )
    return tok, mapped


def child_hf(n: int, tokenizer_file: str) -> None:
    import torch
    from transformers import DataCollatorForLanguageModeling

    started = time.perf_counter()
    tok, mapped = _hf_dataset(n, tokenizer_file)
    mapped_at = time.perf_counter()
    loader = torch.utils.data.DataLoader(
        mapped, batch_size=8, shuffle=True, collate_fn=DataCollatorForLanguageModeling(tok, mlm=False)
    )
    next(iter(loader))
    first = time.perf_counter()
    print(json.dumps({"tokenize_s": round(mapped_at - started, 2), "plan_s": round(first - mapped_at, 2)}))


def child_hf_worker(n: int, tokenizer_file: str) -> None:
    """A Trainer-style data-parallel worker: the mapped dataset, a DistributedSampler, the model, 3 steps."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling

    from neurontrain.model.build import build_config
    from neurontrain.recipe import load_recipe

    dist.init_process_group("gloo")
    tok, mapped = _hf_dataset(n, tokenizer_file)
    sampler = torch.utils.data.DistributedSampler(mapped, shuffle=True)
    loader = torch.utils.data.DataLoader(
        mapped, batch_size=8, sampler=sampler, collate_fn=DataCollatorForLanguageModeling(tok, mlm=False)
    )
    model = AutoModelForCausalLM.from_config(build_config(load_recipe(RECIPE, _overrides(n)), tok))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    for _, batch in zip(range(3), loader, strict=False):
        ddp(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()
    print(json.dumps({"ok": True}))


def measure(n: int, root: Path) -> dict:
    env = dict(
        os.environ, PJRT_DEVICE="CPU", NEURONTRAIN_DATA_CACHE=str(root / "store"), HF_DATASETS_CACHE=str(root / "hf")
    )
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    ours_cold = _child_json(["--child", "ours", "--samples", str(n)], env)
    ours_warm = _child_json(["--child", "ours", "--samples", str(n)], env)
    tokenizer_file = str(Path(ours_cold["store"]) / "tokenizer.json")
    hf_cold = _child_json(["--child", "hf", "--samples", str(n), "--tokenizer", tokenizer_file], env)
    hf_warm = _child_json(["--child", "hf", "--samples", str(n), "--tokenizer", tokenizer_file], env)
    out = {
        "samples": n,
        "neurontrain": {
            "tokenize_first_s": ours_cold["tokenize_s"],
            "tokenize_cached_s": ours_warm["tokenize_s"],
            "plan_s": ours_warm["plan_s"],
            "prepare_rss_gb": ours_warm["rss_gb"],
            "cached_run_tokenized": ours_warm["tokenized"],
        },
        "hf_datasets": {
            "tokenize_first_s": hf_cold["tokenize_s"],
            "tokenize_cached_s": hf_warm["tokenize_s"],
            "first_batch_s": hf_warm["plan_s"],
            "prepare_rss_gb": hf_warm["rss_gb"],
        },
    }
    for workers in (1, 2):
        run_dir = root / f"run{workers}"
        ours = [
            sys.executable,
            "-m",
            "neurontrain",
            "run",
            str(RECIPE),
            "--backend",
            "eager",
            "--no-preflight",
            "--output-dir",
            str(run_dir),
            "--nproc-per-node",
            str(workers),
        ]
        for item in _overrides(n) + ["checkpoint.every=0", "checkpoint.save_final=false", "train.eval_at_end=false"]:
            ours += ["--set", item]
        peaks = _peaks(ours, env)
        out["neurontrain"][f"rss_{workers}_workers"] = {
            "launcher_gb": peaks["root_gb"],
            "workers_gb": peaks["workers_gb"],
        }
        hf = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={workers}",
            __file__,
            "--child",
            "hf-worker",
            "--samples",
            str(n),
            "--tokenizer",
            tokenizer_file,
        ]
        peaks = _peaks(hf, env)
        out["hf_datasets"][f"rss_{workers}_workers"] = {
            "launcher_gb": peaks["root_gb"],
            "workers_gb": peaks["workers_gb"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--child", choices=("ours", "hf", "hf-worker"))
    parser.add_argument("--samples", type=int)
    parser.add_argument("--tokenizer")
    args = parser.parse_args()
    if args.child == "ours":
        return child_ours(args.samples)
    if args.child == "hf":
        return child_hf(args.samples, args.tokenizer)
    if args.child == "hf-worker":
        return child_hf_worker(args.samples, args.tokenizer)
    results = []
    for n in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="data-scale-") as root:
            results.append(measure(n, Path(root)))
        print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps({"benchmark": "data_scale", "results": results}, indent=1))


if __name__ == "__main__":
    main()
