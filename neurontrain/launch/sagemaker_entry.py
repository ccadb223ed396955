"""Inside a SageMaker training container: what the entry script does on each instance.

The training toolkit has already JSON-decoded every hyperparameter when it writes SM_HPS, so the recipe is
rebuilt from the values as delivered (decoding again would turn "tiny-llama-clm" into a JSONDecodeError).
Channel paths in the recipe (/opt/ml/input/data/NAME/...) are mapped through the toolkit's SM_CHANNEL_NAME; a
channel directory holding one data file stands for that file. The instance then runs `python -m neurontrain run`
(with `run`'s worker arguments from the neurontrain_run_args hyperparameter) as one torchrun agent of a static
rendezvous (node rank = index in SM_HOSTS, master = the first host), prints each metrics record as a line
SageMaker's metric regexes read, and on the first host moves the final model to SM_MODEL_DIR and the summary and
metrics to SM_OUTPUT_DATA_DIR. A Lightning job (neurontrain_lightning hyperparameter) runs `neurontrain run
--lightning "SCRIPT ARGS"` instead, with the script from the job's source folder.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from neurontrain.errors import UsageError
from neurontrain.fileio import write_json_atomic
from neurontrain.launch.ray_hosts import RAY_PORT, HostRole, run_head, run_member
from neurontrain.launch.sagemaker import (
    CHANNEL_ROOT,
    CHECKPOINT_DIR,
    HP_PREFIX,
    LIGHTNING_HP,
    LIGHTNING_SOURCE,
    METRIC_PREFIX,
    RUN_ARGS_HP,
)
from neurontrain.launch.sagemaker_groups import host_role

MASTER_PORT = 29500
PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the directory holding this copy of the neurontrain package
_CHANNEL_KEYS = (("data", "path"), ("model", "pretrained"), ("tokenizer", "pretrained"))


def recipe_from_hyperparameters(hps: dict[str, Any]) -> dict:
    """The recipe from hyperparameters as the toolkit delivers them (SM_HPS: values already decoded)."""
    recipe: dict = {}
    for key, value in hps.items():
        if not key.startswith(HP_PREFIX):
            continue
        node = recipe
        *parents, leaf = key[len(HP_PREFIX) :].split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    if not recipe:
        raise UsageError("no recipe.* hyperparameters: this job was not created by `neurontrain submit sagemaker`")
    return recipe


def map_channels(recipe: dict, channels: dict[str, str]) -> dict:
    """Recipe paths under /opt/ml/input/data/NAME -> the toolkit's directory for channel NAME; a directory
    with exactly one file stands for that file (data.path names a file)."""
    for section, key in _CHANNEL_KEYS:
        value = (recipe.get(section) or {}).get(key)
        if not isinstance(value, str) or not value.startswith(CHANNEL_ROOT + "/"):
            continue
        name, _, rest = value[len(CHANNEL_ROOT) + 1 :].partition("/")
        if name not in channels:
            raise UsageError(
                f"{section}.{key} {value} names channel {name!r}, which this job does not have "
                f"(channels: {', '.join(sorted(channels)) or 'none'})"
            )
        path = Path(channels[name]) / rest if rest else Path(channels[name])
        if section == "data" and path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            if len(files) != 1:
                raise UsageError(
                    f"channel {name!r} holds {len(files)} files ({', '.join(p.name for p in files[:5])})"
                    f"; point data.path at one: --set data.path={CHANNEL_ROOT}/{name}/FILE"
                )
            path = files[0]
        recipe[section] = {**recipe[section], key: str(path)}
    return recipe


def worker_args(hps: dict[str, Any]) -> list[str]:
    """`run`'s worker arguments that `submit sagemaker` passed in the neurontrain_run_args hyperparameter."""
    args = hps.get(RUN_ARGS_HP) or []
    if not isinstance(args, list) or not all(isinstance(word, str) for word in args):
        raise UsageError(f"hyperparameter {RUN_ARGS_HP} must be a JSON list of strings, not {args!r}")
    return args


def run_argv(
    recipe_file: str,
    output_dir: str,
    hosts: list[str],
    current_host: str,
    nproc: int,
    worker_arguments: Sequence[str] = (),
) -> list[str]:
    """`neurontrain run` for this instance: one torchrun agent of a static rendezvous across the instances."""
    argv = ["run", recipe_file, "--output-dir", output_dir, *worker_arguments, "--nproc-per-node", str(nproc)]
    return argv + _node_arguments(hosts, current_host)


def lightning_run_argv(command: Any, hosts: list[str], current_host: str, nproc: int) -> list[str]:
    """`neurontrain run --lightning` for this instance: the script (shipped in the source folder) as this node's
    torchrun workers, one agent of a static rendezvous across the instances."""
    if not isinstance(command, str) or not command.strip():
        raise UsageError(f'hyperparameter {LIGHTNING_HP} must be "SCRIPT ARGS", not {command!r}')
    script, *rest = shlex.split(command)
    path = PACKAGE_PARENT / LIGHTNING_SOURCE / script
    if not path.is_file():
        raise UsageError(f"{script} is not in the job's source ({PACKAGE_PARENT / LIGHTNING_SOURCE})")
    argv = ["run", "--lightning", shlex.join([str(path), *rest]), "--nproc-per-node", str(nproc)]
    return argv + _node_arguments(hosts, current_host)


def _node_arguments(hosts: list[str], current_host: str) -> list[str]:
    if len(hosts) == 1:
        return []
    node_rank = str(hosts.index(current_host))
    return ["--nnodes", str(len(hosts)), "--node-rank", node_rank, "--master-addr", hosts[0], "--master-port",
            str(MASTER_PORT)]  # fmt: skip


def run_neurontrain(argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> int:
    """`python -m neurontrain ARGV` with this copy of the package first on the path (and `env` added); its
    exit code."""
    path = os.pathsep.join(p for p in (str(PACKAGE_PARENT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "neurontrain", *argv], env={**os.environ, **(env or {}), "PYTHONPATH": path}, cwd=cwd
    ).returncode


class MetricsFollower(threading.Thread):
    """Prints each new metrics.jsonl record as `neurontrain metric: {...}` (the request's metric regexes)."""

    def __init__(self, path: Path, out: TextIO, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.path, self.out, self.interval = path, out, interval
        self.offset = 0
        self.done = threading.Event()

    def poll(self) -> None:
        try:
            size = self.path.stat().st_size
        except OSError:
            return
        if size < self.offset:  # rewritten by a resumed run
            self.offset = 0
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line.strip():
                print(f"{METRIC_PREFIX} {line.strip()}", file=self.out, flush=True)

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.poll()

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.poll()


def publish(output_dir: Path, model_dir: Path, data_dir: Path | None) -> None:
    """Move the final model to SM_MODEL_DIR (SageMaker uploads it as model.tar.gz) and copy the run's summary
    and metrics to SM_OUTPUT_DATA_DIR (output.tar.gz)."""
    model = output_dir / "model"
    if model.is_dir():
        model_dir.mkdir(parents=True, exist_ok=True)
        for item in model.iterdir():
            target = model_dir / item.name
            if target.is_dir():
                shutil.rmtree(target)
            shutil.move(str(item), str(target))
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
        for name in ("summary.json", "metrics.jsonl", "preflight.jsonl"):
            if (output_dir / name).is_file():
                shutil.copy2(output_dir / name, data_dir / name)


def _env_json(name: str, env: dict[str, str]) -> Any:
    if name not in env:
        raise UsageError(f"{name} is not set: run this entry script under the SageMaker training toolkit")
    return json.loads(env[name])


def _checkpoint_dir(env: dict[str, str]) -> Path:
    base = env.get("SAGEMAKER_BASE_DIR")  # the toolkit's own relocation of /opt/ml (local mode)
    return Path(base) / "checkpoints" if base else Path(CHECKPOINT_DIR)


def lightning_main(hps: dict[str, Any], hosts: list[str], current: str, env: dict[str, str],
                   runner: Callable[..., int] | None = None) -> int:  # fmt: skip
    """A Lightning job: the script runs in the checkpoint directory, so what it writes under relative paths
    (its output folder, Lightning's last.ckpt) is synced to S3 and there again when SageMaker retries the job."""
    try:
        argv = lightning_run_argv(hps[LIGHTNING_HP], hosts, current, int(env.get("NEURONTRAIN_NPROC_PER_NODE", "1")))
    except UsageError as exc:
        print(f"neurontrain: error: {exc}", file=sys.stderr)
        return 2
    workdir = _checkpoint_dir(env)
    workdir.mkdir(parents=True, exist_ok=True)
    return (runner or run_neurontrain)(argv, cwd=workdir)


def resource_config(env: dict[str, str]) -> dict:
    """/opt/ml/input/config/resourceconfig.json (under SAGEMAKER_BASE_DIR where the toolkit relocates /opt/ml)."""
    base = Path(env.get("SAGEMAKER_BASE_DIR", "/opt/ml"))
    path = base / "input" / "config" / "resourceconfig.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def main(env: dict[str, str] | None = None, runner: Callable[..., int] | None = None) -> int:
    env = dict(os.environ) if env is None else env
    try:
        hps, hosts = _env_json("SM_HPS", env), _env_json("SM_HOSTS", env)
        current = env.get("SM_CURRENT_HOST", hosts[0])
        if LIGHTNING_HP in hps:
            return lightning_main(hps, hosts, current, env, runner)
        groups = recipe_from_hyperparameters(hps).get("cluster", {}).get("groups") or []
        role = host_role(resource_config(env), groups) if groups else None
        if role is not None and not role.is_head:
            return member_main(role, env)
        channels = {
            name: env.get(f"SM_CHANNEL_{name.upper()}", f"{CHANNEL_ROOT}/{name}")
            for name in json.loads(env.get("SM_CHANNELS", "[]"))
        }
        recipe = map_channels(recipe_from_hyperparameters(hps), channels)
        arguments = worker_args(hps)
    except (UsageError, json.JSONDecodeError) as exc:
        print(f"neurontrain: error: {exc}", file=sys.stderr)
        return 2
    output_dir = _checkpoint_dir(env)
    recipe_file = output_dir / "sagemaker-recipe.json"
    write_json_atomic(recipe_file, recipe)
    nproc = int(env.get("NEURONTRAIN_NPROC_PER_NODE", "1"))
    if role is not None:
        return head_main(role, str(recipe_file), output_dir, nproc, arguments, env, runner)
    first = current == hosts[0]
    follower = MetricsFollower(output_dir / "metrics.jsonl", sys.stdout) if first else None
    if follower:
        follower.start()
    try:
        code = (runner or run_neurontrain)(
            run_argv(str(recipe_file), str(output_dir), hosts, current, nproc, arguments)
        )
    finally:
        if follower:
            follower.stop()
    if code == 0 and first:
        data_dir = env.get("SM_OUTPUT_DATA_DIR")
        publish(output_dir, Path(env.get("SM_MODEL_DIR", "/opt/ml/model")), Path(data_dir) if data_dir else None)
    return code


def head_main(role: HostRole, recipe_file: str, output_dir: Path, nproc: int, arguments: list[str],
              env: dict[str, str], runner: Callable[..., int] | None = None) -> int:  # fmt: skip
    """The first data host of a heterogeneous job: the Ray head and the run's driver (`run --launcher ray`);
    the Trainium hosts run the workers, nproc each."""
    argv = ["run", recipe_file, "--output-dir", str(output_dir), *arguments, "--launcher", "ray",
            "--nproc-per-node", str(nproc), "--nnodes", str(len(role.trainium_hosts))]  # fmt: skip
    return run_head(
        role,
        lambda ray_env: (runner or run_neurontrain)(argv, env=ray_env),
        port=int(env.get("NEURONTRAIN_RAY_PORT", RAY_PORT)),
        ray_args=shlex.split(env.get("NEURONTRAIN_RAY_START_ARGS", "")),
    )


def member_main(role: HostRole, env: dict[str, str]) -> int:
    """Any other host of a heterogeneous job: a Ray node until the head says training ended; then, on the
    Trainium host where worker 0 wrote the run, the model and summary go where SageMaker uploads them."""
    code = run_member(
        role,
        port=int(env.get("NEURONTRAIN_RAY_PORT", RAY_PORT)),
        ray_args=shlex.split(env.get("NEURONTRAIN_RAY_START_ARGS", "")),
    )
    output_dir = _checkpoint_dir(env)
    if code == 0 and (output_dir / "summary.json").is_file():
        data_dir = env.get("SM_OUTPUT_DATA_DIR")
        publish(output_dir, Path(env.get("SM_MODEL_DIR", "/opt/ml/model")), Path(data_dir) if data_dir else None)
    return code
