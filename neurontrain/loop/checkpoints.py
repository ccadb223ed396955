"""Training checkpoints: atomic directories with a completion marker, keep-last-N, resume from the newest.

Layout: <root>/step_00000020/{state.pt, meta.json, COMPLETE}. A checkpoint is written into
<root>/.step_00000020.partial/ and renamed into place only after every file is on disk and the marker is
written, so a kill at any moment leaves either the old set of checkpoints or the new one. What state.pt and
meta.json hold is the trainer's to say (`Trainer.state_dict`, `Trainer.load_state_dict`). A ZeRO-1 run adds one
optimizer file per data-parallel rank, `optim.dp_rank_XX.tp_rank_00` (NxD's name for the same dict), each
written by its own rank before worker 0 writes the marker.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from neurontrain.errors import UsageError
from neurontrain.fileio import fsync_path
from neurontrain.recipe import Recipe

MARKER = "COMPLETE"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def steps_to_prune(steps: list[int], keep: int) -> list[int]:
    """Pure: which complete checkpoints to delete so that only the newest `keep` remain."""
    ordered = sorted(steps)
    return ordered[:-keep] if keep > 0 and len(ordered) > keep else []


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint under `root` with its marker and state, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_dir() and (entry / MARKER).is_file() and (entry / STATE_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def remove_partial(root: Path) -> list[str]:
    """Delete leftovers of interrupted writes (and step dirs without a marker)."""
    removed = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if entry.name.endswith(".partial") or (_NAME.match(entry.name) and not (entry / MARKER).is_file()):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def save_checkpoint(
    root: Path,
    step: int,
    state: dict,
    meta: dict,
    keep: int,
    save_fn: Callable[[Any, str], None],
    is_master: bool = True,
    all_ranks_save: bool = True,
    rank_file: tuple[int, dict] | dict[str, Any] | None = None,
    barrier: Callable[[], None] = lambda: None,
    shard_writer: Callable[[Path], None] | None = None,
) -> Path | None:
    """Write `state` with save_fn (xm.save on XLA: CPU tensors, master only), then publish atomically.
    all_ranks_save: every rank calls save_fn (a collective, such as xm.save across xla workers). rank_file:
    what this rank writes of its own, (rank, CPU state) for its ZeRO-1 file, or {path in the checkpoint:
    content} (JSON for *.json, else torch.save); every rank passes one, and `barrier` waits for all. shard_writer:
    what every rank writes into the checkpoint directory (FSDP2's DCP shards: a collective), between barriers."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    partial = root / f".{checkpoint_name(step)}.partial"
    if is_master:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    if rank_file is not None or shard_writer is not None:
        barrier()  # the directory exists
        if rank_file is None or isinstance(rank_file, dict):
            files = rank_file or {}
        else:
            files = {rank_file_name(rank_file[0]): rank_file[1]}
        for name, content in files.items():
            _write_rank_file(partial / name, content)
        if shard_writer is not None:
            shard_writer(partial)
        barrier()  # every rank's file is on disk before the marker
    if not is_master and not all_ranks_save:
        return None
    save_fn(state, str(partial / STATE_FILE))  # collective on XLA: every rank calls it
    if all_ranks_save:
        barrier()  # no rank is still writing when worker 0 renames the directory
    if not is_master:
        return None
    (partial / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    for name in (STATE_FILE, META_FILE):
        fsync_path(partial / name)
    with open(partial / MARKER, "w") as fh:
        fh.write(f"{step}\n")
        fh.flush()
        os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(partial, final)
    fsync_path(root)
    by_step = dict(complete_checkpoints(root))
    for old in steps_to_prune(list(by_step), keep):
        shutil.rmtree(by_step[old], ignore_errors=True)
    return final


def _write_rank_file(path: Path, content: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(content, indent=2, sort_keys=True))
    else:
        torch.save(content, path)
    fsync_path(path)


def rank_file_name(rank: int) -> str:
    return f"optim.dp_rank_{rank:02d}.tp_rank_00"


def load_rank_files(path: Path, ranks: list[int]) -> list[dict]:
    """The per-rank optimizer files of `ranks` in a checkpoint directory, tensors on the CPU."""
    out = []
    for rank in ranks:
        file = path / rank_file_name(rank)
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint {path} lacks {file.name} (a ZeRO-1 checkpoint has one per rank)")
        out.append(torch.load(file, map_location="cpu", weights_only=False))
    return out


def load_checkpoint(path: Path) -> tuple[dict, dict]:
    """(state, meta) of a complete checkpoint directory, tensors on the CPU."""
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    meta = json.loads((path / META_FILE).read_text())
    return state, meta


def global_fingerprint(recipe: Recipe, world: int) -> str:
    """The recipe's fingerprint with per-worker batch sizes made global: equal for two runs that compute the
    same global batches, whatever their number of workers (a checkpoint resumes across world sizes then)."""
    data = recipe.data
    rows = {"batch_size": data.batch_size * world, "eval_batch_size": (data.eval_batch_size or data.batch_size) * world}
    train = recipe.train.model_copy(update={"global_batch_size": None})
    return recipe.model_copy(update={"data": data.model_copy(update=rows), "train": train}).fingerprint()


def check_resumable(path: Path, meta: dict, recipe: Recipe, world: int) -> None:
    """UsageError unless the checkpoint at `path` continues this run: the same recipe and number of workers, or
    the same global batches (its data position counts global batches)."""
    same_global_batches = meta.get("global_fingerprint") == global_fingerprint(recipe, world)
    if meta.get("fingerprint") != recipe.fingerprint() and not same_global_batches:
        raise UsageError(
            f"checkpoint {path} was written by a different recipe; use another --output-dir "
            "or set checkpoint.resume=false"
        )
    if meta.get("world_size", 1) != world and not same_global_batches:
        raise UsageError(
            f"checkpoint {path} was written by {meta.get('world_size', 1)} workers, this run has {world} (its data "
            "position counts global batches of that size); use another --output-dir, the same number of workers, "
            "or the same global batch (data.batch_size x workers)"
        )
