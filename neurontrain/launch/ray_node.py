"""One host of a heterogeneous Slurm job (what `submit slurm --data-nodes K` has srun run on every node):

    python -m neurontrain.launch.ray_node HOST -- run RECIPE ... --launcher ray ...

The hosts come from the environment the sbatch script exports: NEURONTRAIN_DATA_HOSTS and
NEURONTRAIN_TRAINIUM_HOSTS (comma-separated, Slurm's node names), NEURONTRAIN_HEAD_ADDRESS (where the others reach
the first data host), NEURONTRAIN_RAY_PORT and NEURONTRAIN_RAY_START_ARGS. The first data host is the Ray head and
runs `neurontrain` with the arguments after `--` as the driver; every other host joins and leaves when the head
says training ended (`ray_hosts`).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from neurontrain.errors import UsageError
from neurontrain.launch.ray_hosts import RAY_PORT, HostRole, run_head, run_member


def role_from(host: str, env: dict[str, str]) -> HostRole:
    data = tuple(h for h in env.get("NEURONTRAIN_DATA_HOSTS", "").split(",") if h)
    trainium = tuple(h for h in env.get("NEURONTRAIN_TRAINIUM_HOSTS", "").split(",") if h)
    if not data or not trainium:
        raise UsageError("NEURONTRAIN_DATA_HOSTS and NEURONTRAIN_TRAINIUM_HOSTS must both name hosts")
    if host not in data + trainium:
        raise UsageError(f"host {host!r} is in neither NEURONTRAIN_DATA_HOSTS nor NEURONTRAIN_TRAINIUM_HOSTS")
    role = "data" if host in data else "trainium"
    return HostRole(host, role, data[0], data, trainium, env.get("NEURONTRAIN_HEAD_ADDRESS") or None)


def main(argv: list[str] | None = None, env: dict[str, str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = dict(os.environ) if env is None else env
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m neurontrain.launch.ray_node HOST -- NEURONTRAIN_ARGS...", file=sys.stderr)
        return 2
    try:
        role = role_from(argv[0], env)
    except UsageError as exc:
        print(f"neurontrain: error: {exc}", file=sys.stderr)
        return 2
    port = int(env.get("NEURONTRAIN_RAY_PORT", RAY_PORT))
    ray_args = shlex.split(env.get("NEURONTRAIN_RAY_START_ARGS", ""))
    if not role.is_head:
        return run_member(role, port=port, ray_args=ray_args)
    command = [sys.executable, "-m", "neurontrain", *argv[2:]]
    return run_head(
        role, lambda ray_env: subprocess.run(command, env={**env, **ray_env}).returncode, port=port, ray_args=ray_args
    )


if __name__ == "__main__":
    sys.exit(main())
