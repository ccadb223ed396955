"""The scratch runs the checks share: each `neurontrain` invocation runs once, in its own process, whichever check
asks for it first, in a scratch directory the doctor owns (its own compile cache, its own tiny recipe).

The processes get the user's environment less the variables that would point the runtime at the user's own
cache (so the doctor neither reads nor fills it); everything else, NEURON_CC_FLAGS included, is passed on.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neurontrain.compile.runtime_cache import flag_tokens
from neurontrain.errors import NeurontrainError

# a tiny Llama (grouped-query attention, so tensor parallel splits KV heads) on generated text, one bucket
RECIPE: dict[str, Any] = {
    "name": "doctor-tiny-llama",
    "task": "causal-lm",
    "model": {
        "config": {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "tie_word_embeddings": False,
        }
    },
    "tokenizer": {"word_level": {"vocab_size": 256}},
    "data": {
        "source": "synthetic-text",
        "text_field": "text",
        "label_field": None,
        "train_samples": 256,
        "eval_samples": 16,
        "max_length": 64,
        "batch_size": 16,
        "buckets": [64],
        "packing": "off",  # the N-worker checks compare with one worker on the same global batch of samples
        "seed": 0,
    },
    "train": {
        "max_steps": 6,
        "log_every": 1,
        "eval_at_end": False,
        "optimizer": {"lr": 3.0e-3, "weight_decay": 0.0},
        "schedule": {"kind": "cosine", "warmup_steps": 1},
    },
    "checkpoint": {"every": 2, "keep": 3},
    "runtime": {"preflight": False},  # the collectives check runs the health checks once, for every run
}
PER_WORKER_BATCH = 8  # the runs at N workers take 8 rows each; their one-worker references take 8 x N
CACHE_VARIABLES = ("NEURON_COMPILE_CACHE_URL", "NEURONTRAIN_CACHE_DIR", "NEURON_EXTRACT_GRAPHS_ONLY")


class StageFailed(NeurontrainError):
    """A `neurontrain` process a check needed did not succeed: the check fails with this line."""


def scratch_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The user's environment with the runtime's cache left to the doctor: no cache URL, no --cache_dir."""
    env = {k: v for k, v in environ.items() if k not in CACHE_VARIABLES}
    tokens, kept, skip = flag_tokens(env.get("NEURON_CC_FLAGS", "")), [], False
    for token in tokens:
        if skip:
            skip = False
        elif token == "--cache_dir":
            skip = True
        elif not token.startswith("--cache_dir="):
            kept.append(token)
    if "NEURON_CC_FLAGS" in env:
        env["NEURON_CC_FLAGS"] = shlex.join(kept)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class DoctorContext:
    scratch: Path
    nproc: int = 2
    backend: str = "auto"
    env: dict = field(default_factory=lambda: scratch_environment(os.environ))
    modules: dict = field(default_factory=dict)  # workers -> the cache's modules (before, after) their run
    _done: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.scratch.mkdir(parents=True, exist_ok=True)
        (self.scratch / "logs").mkdir(exist_ok=True)
        self.recipe = self.scratch / "recipe.yaml"
        self.recipe.write_text(json.dumps(RECIPE, indent=2))  # JSON is YAML
        self.cache = self.scratch / "cache"

    def once(self, key: str, make: Callable[[], Any]) -> Any:
        """make() the first time `key` is asked for; its result (or its failure) afterwards."""
        if key not in self._done:
            try:
                self._done[key] = (True, make())
            except StageFailed as exc:
                self._done[key] = (False, exc)
        ok, value = self._done[key]
        if not ok:
            raise value
        return value

    def seed(self, key: str, value: Any) -> None:
        """A stage's result made elsewhere (the kept runs of an earlier doctor): `once(key)` returns it."""
        self._done[key] = (True, value)

    def recipe_args(self, workers: int = 1, *extra: str) -> list[str]:
        """The doctor's recipe for `workers` workers (the same global batch at every world size)."""
        args = [str(self.recipe), "--set", f"runtime.compile_cache={self.cache}"]
        args += ["--set", f"data.batch_size={PER_WORKER_BATCH * (self.nproc if workers == 1 else 1)}"]
        if workers > 1:
            args += ["--nproc-per-node", str(workers)]
        if self.backend != "auto":
            args += ["--backend", self.backend]
        return args + list(extra)

    def cli(
        self, stage: str, *args: str, env: Mapping[str, str] | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        """`neurontrain ARGS` in a process of its own, its stderr in logs/<stage>.log; StageFailed on an exit
        other than 0 (with `check`)."""
        log = self.scratch / "logs" / f"{stage}.log"
        with log.open("w") as out:
            proc = subprocess.run(
                [sys.executable, "-m", "neurontrain", *args],
                env={**self.env, **(env or {})},
                stdout=subprocess.PIPE,
                stderr=out,
                text=True,
                timeout=900,
            )
        if check and proc.returncode != 0:
            raise StageFailed(f"`neurontrain {args[0]}` ({stage}) exited {proc.returncode}: {last_error(log)}")
        return proc

    def start(self, stage: str, *args: str) -> subprocess.Popen:
        log = (self.scratch / "logs" / f"{stage}.log").open("w")
        return subprocess.Popen(
            [sys.executable, "-m", "neurontrain", *args],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )

    def has_module(self, name: str) -> bool:
        """Whether the runs' Python (with their environment) can import `name`: asked once, for every check."""
        code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"

        def found() -> bool:
            return subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True).returncode == 0

        return self.once(f"has-module {name}", found)


def last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return ((errors or lines or ["no output"])[-1])[:300] + f" (log: {log})"


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def losses(run_dir: Path) -> dict[int, float]:
    """The training loss of every logged step of a run (metrics.jsonl)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}
