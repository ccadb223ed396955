"""Checkpoint migration at scale: `checkpoint migrate --to neuron --tp 8` and back `--to gpu`, against `cp -r` of the
same bytes, on a generated Hugging Face Llama checkpoint of at least 2 GB (no download). Prints one JSON object.

    python benchmarks/checkpoint_migrate.py [--layers 24] [--rounds 3] [--workdir DIR] [--keep]

The checkpoint: LlamaForCausalLM in bf16 (hidden 4096, intermediate 11008, 32 query / 8 KV heads, vocab 32000,
untied head; the default 24 layers make 9.03 GB, 6 make 2.65 GB), its tensor names and shapes those of the model
built on the meta device, the values seeded random normals generated one tensor at a time, written one shard at a
time as two safetensors files with model.safetensors.index.json and config.json (by a child process: torch stays
out of this one, whose RSS at fork counts in every child's ru_maxrss). A tiny checkpoint of the same architecture
gives the fixed interpreter baseline (imports, the model built on meta, the CLI itself): the same command's peak RSS
and seconds on it.

A first pass migrates each checkpoint to NxD (kept: the input of the `--to gpu` runs) and back, and checks the round
trip with `checkpoint verify --json` (`round_trip_identical`: exit 0 and bit-identical). Then each of --rounds
rounds runs, in an order rotated by one per round, `cp -r` of the HF directory, `--to neuron`, `cp -r` of the NxD
directory, `--to gpu` and both directions on the tiny checkpoint, each a fresh process writing to a fresh
destination that is deleted after measuring (`sync` before each run, so no run pays for the previous one's writes).
migrate fsyncs its files before it renames the destination into place, so each cp is followed by `sync -f` and
timed with it. The children run without PYTHONDONTWRITEBYTECODE, from the bytecode the first pass compiled, as an
installed package starts.
Per direction:

- `seconds`: wall time of the migrate process (interpreter start-up included), the median of the rounds;
- `throughput_vs_cp`: cp's seconds over migrate's in the same round, the median of the rounds' ratios (cp of the
  directory that the migrate reads: the HF one for `--to neuron`, the NxD one for `--to gpu`);
  `throughput_vs_cp_after_startup`: the same with the tiny run's seconds of that round taken off migrate's;
- `peak_rss_bytes`: the migrate process's own ru_maxrss (os.wait4 on it), the largest of the rounds, beside
  `baseline_rss_bytes` (the tiny checkpoint, same direction, median) and `largest_output_file_bytes`; ru_maxrss
  counts mapped file pages (safetensors reads through mmap) as well as anonymous memory, so the peaks of each
  share, sampled every 20 ms from /proc/PID/status, come with it (`peak_rss_anon_sampled_bytes`, `..._file_...`);
- `rss_vs_largest_output_file`: (peak - baseline) / largest output file; `peak_rss_vs_largest_output_file`: the
  same without subtracting the baseline.

Measured on 2 CPU cores (this machine: 24 GiB, ext4 on a virtual disk), with the streaming migrate:

- `--rounds 2` (9.03 GB, 57 tensors; cp from the page cache and disk, 14.6 to 18.6 s): `--to neuron --tp 8` 31.8 s
  median (29.3, 34.2), 0.58 x cp (rounds 0.62, 0.54), 0.68 x after the tiny run's 4.6 s of start-up; peak RSS
  2.12 GB, baseline 0.89 GB, largest output file 1.13 GB (a rank file): 1.09 x (1.87 x without the baseline).
  `--to gpu` 24.1 s (23.7, 24.5), 0.65 x cp (0.71, 0.60), 0.79 x after start-up; peak RSS 1.33 GB, largest
  output file 4.95 GB (two 5 GB-split files): 0.09 x (0.27 x). Round trip bit-identical.
- `--layers 6 --rounds 3` (2.65 GB; cp 2.1 to 3.6 s, from the page cache): `--to neuron` 10.4 s, 0.34 x cp, 0.56 x
  after start-up (4.3 s); peak RSS 1.22 GB, baseline 0.89 GB, largest output file 0.33 GB: 1.005 x. `--to gpu`
  9.1 s, 0.23 x, 0.43 x after start-up; peak RSS 1.47 GB, largest output file 2.65 GB (one file): 0.22 x. Round
  trip bit-identical. At this size the start-up (imports of torch and transformers, the model built on the meta
  device) is half of each run.

Before streaming (the code that read whole tensors for every rank and kept every file mapped), the 2.65 GB run
took 28.2 s (0.073 x cp) and 26.6 s (0.11 x) with peak RSS 7.88 GB (20.8 x the largest output file) and 5.00 GB
(1.90 x).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEADS = {"num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 256,
    "num_hidden_layers": 2,
}


def tensor_shapes(config) -> dict:
    """LlamaForCausalLM's state_dict names and shapes for `config`, from the model built on the meta device."""
    # lazy: only the --generate child imports torch (this process's RSS is part of every child's ru_maxrss)
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


def two_shards(sizes: dict[str, int]) -> list[list[str]]:
    """The names in state_dict order, split where half the bytes are reached."""
    half, seen, first = sum(sizes.values()) / 2, 0, []
    for name, size in sizes.items():
        if seen >= half:
            break
        first.append(name)
        seen += size
    return [first, list(sizes)[len(first) :]]


def write_checkpoint(directory: Path, dims: dict, seed: int = 0) -> dict:
    """A Hugging Face Llama checkpoint of random bf16 weights in two safetensors shards, generated one tensor at
    a time, after checking that the disk holds three times it (source, NxD copy, one destination)."""
    # lazy: only the --generate child imports torch (this process's RSS is part of every child's ru_maxrss)
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(
        **dims,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
    )
    shapes = tensor_shapes(config)
    sizes = {name: shape.numel() * 2 for name, shape in shapes.items()}
    total, free = sum(sizes.values()), shutil.disk_usage(directory.parent).free
    if free < 3 * total + (1 << 30):
        raise SystemExit(
            f"{directory.parent} has {free / 1e9:.1f} GB free; the benchmark needs {3 * total / 1e9:.1f} GB"
        )
    directory.mkdir()
    config.save_pretrained(directory)
    generator = torch.Generator().manual_seed(seed)
    shards = two_shards(sizes)
    weight_map = {}
    for number, names in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: (torch.randn(shapes[name], generator=generator) * 0.02).bfloat16() for name in names}
        save_file(tensors, str(directory / filename), metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys(names, filename))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"tensors": len(sizes), "tensor_bytes": total}


def generate(directory: Path, dims: dict) -> dict:
    """write_checkpoint in a child process (torch stays out of this one); returns its report."""
    cmd = [sys.executable, __file__, "--generate", str(directory), "--dims", json.dumps(dims)]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"generating {directory.name} failed: {res.stderr[-3000:]}")
    return json.loads(res.stdout)


def file_sizes(directory: Path) -> list[int]:
    return [path.stat().st_size for path in directory.rglob("*") if path.is_file()]


def durable_copy(src: Path, dst: Path) -> list[str]:
    """`cp -r`, then `sync -f` of the copy's filesystem: migrate fsyncs what it writes before it renames the
    destination into place, so the copy it is compared with must be on disk too (nothing else is dirty: every
    run starts after a sync)."""
    return ["sh", "-c", 'cp -r "$0" "$1" && sync -f "$1"', str(src), str(dst)]


def child_environment() -> dict[str, str]:
    """This environment without PYTHONDONTWRITEBYTECODE: an installed neurontrain starts from compiled bytecode
    (the first, untimed pass writes it), which that variable would have every run compile again."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return env | {"PYTHONUNBUFFERED": "1"}


def migrate_command(src: Path, dst: Path, to: str, tp: int) -> list[str]:
    cmd = [sys.executable, "-m", "neurontrain", "checkpoint", "migrate", str(src), str(dst), "--to", to]
    return cmd + (["--tp", str(tp)] if to == "neuron" else [])


def sample_rss(pid: int, peaks: dict[str, int]) -> None:
    """Raise `peaks` (RssAnon, RssFile in bytes) to the process's current figures from /proc/PID/status."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        key, _, value = line.partition(":")
        if key in peaks:
            peaks[key] = max(peaks[key], int(value.split()[0]) * 1024)


def measured(cmd: list[str]) -> dict:
    """Wall seconds of `cmd` in a fresh process and that process's own peak RSS in bytes: its ru_maxrss, from
    os.wait4 on its pid (RUSAGE_CHILDREN would be the largest of all children so far), and the peaks of its
    anonymous and file-backed (mmap) shares, sampled every 20 ms."""
    peaks = {"RssAnon": 0, "RssFile": 0}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, env=child_environment())
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            sample_rss(proc.pid, peaks)
            time.sleep(0.02)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read()[-3000:].decode(errors="replace")
            raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{tail}")
    return {
        "seconds": seconds,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "peak_rss_anon_sampled_bytes": peaks["RssAnon"],
        "peak_rss_file_sampled_bytes": peaks["RssFile"],
    }


def run_once(cmd: list[str], dst: Path, keep: bool = False) -> dict:
    """One measured run writing `dst`, with what it wrote; `dst` is deleted afterwards unless `keep`."""
    os.sync()
    run = measured(cmd)
    sizes = file_sizes(dst)
    if not keep:
        shutil.rmtree(dst)
    return {
        **run,
        "output_files": len(sizes),
        "output_bytes": sum(sizes),
        "largest_output_file_bytes": max(sizes),
    }


def verify(a: Path, b: Path) -> dict:
    """`checkpoint verify A B --json`: its exit status and its comparison (bit-identical by default)."""
    cmd = [sys.executable, "-m", "neurontrain", "checkpoint", "verify", str(a), str(b), "--json"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    try:
        comparison = json.loads(res.stdout)
    except json.JSONDecodeError:
        print(f"checkpoint verify printed no JSON (exit {res.returncode}): {res.stderr[-2000:]}", file=sys.stderr)
        comparison = {}
    return {
        "identical": res.returncode == 0 and comparison.get("equal") is True,
        "exit": res.returncode,
        "tensors": comparison.get("tensors"),
        "max_abs_diff": comparison.get("max_abs_diff"),
        "differing": len(comparison.get("differing", [])),
    }


def first_pass(work: Path, name: str, dims: dict, tp: int) -> tuple[Path, Path, dict]:
    """Write the checkpoint `name`, migrate it to NxD (kept) and back, and verify the round trip. Returns the HF
    and NxD directories and the two runs' measurements with the verification and the checkpoint's report."""
    hf, nxd, back = work / f"{name}-hf", work / f"{name}-nxd", work / f"{name}-back"
    start = time.perf_counter()
    written = generate(hf, dims)
    log(f"{name}: wrote {written['tensor_bytes'] / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")
    runs = {
        "to_neuron": run_once(migrate_command(hf, nxd, "neuron", tp), nxd, keep=True),
        "to_gpu": run_once(migrate_command(nxd, back, "gpu", tp), back, keep=True),
    }
    runs["verify"] = verify(hf, back)
    runs["checkpoint"] = {**dims, **written, "files": sorted(path.name for path in hf.iterdir())}
    shutil.rmtree(back)
    log(f"{name}: first pass {summary_line(runs)}, round trip identical: {runs['verify']['identical']}")
    return hf, nxd, runs


def timed_rounds(work: Path, sources: dict[str, Path], rounds: int, tp: int) -> dict[str, list[dict]]:
    """Each round runs every contender once, in an order rotated by one per round. `sources`: the directories
    big-hf, big-nxd, tiny-hf, tiny-nxd."""
    commands = {
        "cp_hf": lambda dst: durable_copy(sources["big-hf"], dst),
        "to_neuron": lambda dst: migrate_command(sources["big-hf"], dst, "neuron", tp),
        "cp_nxd": lambda dst: durable_copy(sources["big-nxd"], dst),
        "to_gpu": lambda dst: migrate_command(sources["big-nxd"], dst, "gpu", tp),
        "tiny_to_neuron": lambda dst: migrate_command(sources["tiny-hf"], dst, "neuron", tp),
        "tiny_to_gpu": lambda dst: migrate_command(sources["tiny-nxd"], dst, "gpu", tp),
    }
    runs: dict[str, list[dict]] = {name: [] for name in commands}
    for r in range(rounds):
        order = list(commands)[r % len(commands) :] + list(commands)[: r % len(commands)]
        for name in order:
            dst = work / f"round{r}-{name}"
            runs[name].append(run_once(commands[name](dst), dst))
        log(f"round {r + 1}/{rounds}: {summary_line({name: runs[name][-1] for name in order})}")
    return runs


def summary_line(runs: dict) -> str:
    return ", ".join(
        f"{name} {run['seconds']:.1f} s / {run['peak_rss_bytes'] / 1e9:.2f} GB RSS"
        f" ({run['peak_rss_anon_sampled_bytes'] / 1e9:.2f} anon)"
        for name, run in runs.items()
        if "seconds" in run
    )


def direction(runs: list[dict], cp_runs: list[dict], baseline_runs: list[dict]) -> dict:
    """One direction's figures: `runs` of the migrate, `cp_runs` of cp -r of its input, `baseline_runs` of the
    same migrate on the tiny checkpoint, one of each per round."""

    def each(key: str, rows: list[dict]) -> list:
        return [row[key] for row in rows]

    seconds, cp_seconds, baseline_seconds = (each("seconds", rows) for rows in (runs, cp_runs, baseline_runs))
    ratios = [cp / s for cp, s in zip(cp_seconds, seconds, strict=True)]
    after_startup = [cp / (s - b) for cp, s, b in zip(cp_seconds, seconds, baseline_seconds, strict=True)]
    peak, baseline = max(each("peak_rss_bytes", runs)), statistics.median(each("peak_rss_bytes", baseline_runs))
    largest = runs[-1]["largest_output_file_bytes"]
    return {
        "seconds": statistics.median(seconds),
        "cp_seconds": statistics.median(cp_seconds),
        "throughput_vs_cp": statistics.median(ratios),
        "baseline_seconds": statistics.median(baseline_seconds),
        "throughput_vs_cp_after_startup": statistics.median(after_startup),
        "peak_rss_bytes": peak,
        "baseline_rss_bytes": baseline,
        "largest_output_file_bytes": largest,
        "rss_vs_largest_output_file": (peak - baseline) / largest,
        "peak_rss_vs_largest_output_file": peak / largest,
        "peak_rss_anon_sampled_bytes": max(each("peak_rss_anon_sampled_bytes", runs)),
        "peak_rss_file_sampled_bytes": max(each("peak_rss_file_sampled_bytes", runs)),
        "input_files": cp_runs[-1]["output_files"],
        "input_bytes": cp_runs[-1]["output_bytes"],
        "output_files": runs[-1]["output_files"],
        "output_bytes": runs[-1]["output_bytes"],
        "rounds": {
            "seconds": seconds,
            "cp_seconds": cp_seconds,
            "baseline_seconds": baseline_seconds,
            "throughput_vs_cp": ratios,
            "peak_rss_bytes": each("peak_rss_bytes", runs),
            "baseline_rss_bytes": each("peak_rss_bytes", baseline_runs),
        },
    }


def benchmark(work: Path, dims: dict, rounds: int, tp: int) -> dict:
    big_hf, big_nxd, first = first_pass(work, "big", dims, tp)  # first: its generation checks the free disk
    tiny_hf, tiny_nxd, tiny = first_pass(work, "tiny", TINY, tp)
    sources = {"big-hf": big_hf, "big-nxd": big_nxd, "tiny-hf": tiny_hf, "tiny-nxd": tiny_nxd}
    runs = timed_rounds(work, sources, rounds, tp)
    return {
        "checkpoint": first["checkpoint"],
        "tp": tp,
        "rounds": rounds,
        "round_trip_identical": first["verify"]["identical"],
        "verify": first["verify"],
        "tiny_round_trip_identical": tiny["verify"]["identical"],
        "to_neuron": direction(runs["to_neuron"], runs["cp_hf"], runs["tiny_to_neuron"]),
        "to_gpu": direction(runs["to_gpu"], runs["cp_nxd"], runs["tiny_to_gpu"]),
    }


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24: 9.03 GB, 6: 2.65 GB)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (a multiple of 32)")
    parser.add_argument("--intermediate", type=int, default=11008, help="MLP intermediate size")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, help="where the checkpoints go (default: the system temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    parser.add_argument("--generate", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dims", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate:
        print(json.dumps(write_checkpoint(args.generate, args.dims)))
        return
    if args.layers < 1 or args.rounds < 1 or args.hidden % HEADS["num_attention_heads"]:
        parser.error("--layers and --rounds must be at least 1, --hidden a multiple of 32")
    dims = {"hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers}
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="checkpoint-migrate-", dir=args.workdir))
    log(f"working under {work}")
    try:
        result = benchmark(work, dims | HEADS, args.rounds, args.tp)
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
