"""`run RECIPE --launcher ray`: the workers as a Ray Train worker group on trainium-labelled nodes.

The group gets the toolkit's own backend (`NeurontrainBackend`): the environment torchrun gives its workers
(ranks, MASTER_ADDR/PORT, the restart count) plus NEURON_RT_ROOT_COMM_ID, after which each worker runs the
same entry as under torchrun (`train_as_worker`: preflight, trainer, checkpoints, guard) and joins its process
group itself (gloo on XLA:CPU, xla on Neuron). With data.service.kind ray the training batches stream from the
data nodes (`neurontrain.data.ray_service`). Restarts (`--max-restarts`) are Ray Train's: the whole group
starts again and resumes from the newest checkpoint, at its data position.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from neurontrain.backends import resolve_backend_name
from neurontrain.checkpoint.initial import InitialCheckpoint
from neurontrain.data.ray_service import ServedData, import_ray, prepare_on_data_nodes, selector
from neurontrain.errors import UsageError
from neurontrain.launch.ray_cluster import check_roles, join_cluster, placement
from neurontrain.launch.run import train_as_worker
from neurontrain.launch.topology import Topology
from neurontrain.logs import get_logger
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import Recipe

log = get_logger(__name__)


def torchrun_environment(context: dict[str, int], master: tuple[str, int, int], restart: int) -> dict[str, str]:
    """What torchrun exports to a worker, for the Ray Train worker at `context` (rank, world, local_rank,
    local_world, node_rank), plus the Neuron root communicator on the first worker's host."""
    addr, port, comm_port = master
    return {
        "RANK": str(context["rank"]),
        "WORLD_SIZE": str(context["world"]),
        "LOCAL_RANK": str(context["local_rank"]),
        "LOCAL_WORLD_SIZE": str(context["local_world"]),
        "GROUP_RANK": str(context["node_rank"]),
        "NODE_RANK": str(context["node_rank"]),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "NEURON_RT_ROOT_COMM_ID": f"{addr}:{comm_port}",
    }


def _master_address() -> tuple[str, int, int]:
    """This host's address and two free ports (the process group's store, the Neuron root communicator)."""
    import ray  # lazy: runs inside a Ray worker

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("", 0))
            ports.append(s.getsockname()[1])
    return ray.util.get_node_ip_address(), ports[0], ports[1]


def _export(master: tuple[str, int, int], restart: int) -> None:
    import ray.train  # lazy: runs inside a Ray Train worker

    c = ray.train.get_context()
    context = {
        "rank": c.get_world_rank(),
        "world": c.get_world_size(),
        "local_rank": c.get_local_rank(),
        "local_world": c.get_local_world_size(),
        "node_rank": c.get_node_rank(),
    }
    os.environ.update(torchrun_environment(context, master, restart))


def _backend_classes() -> tuple[type, type]:
    """The Ray Train backend and its config (classes made once Ray is imported: Ray is an optional extra)."""
    from ray.train.backend import Backend, BackendConfig  # lazy: the optional extra

    class NeurontrainBackend(Backend):
        starts = 0  # the controller keeps one backend across the group's restarts

        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            master = worker_group.execute_single(0, _master_address)
            worker_group.execute(_export, master, NeurontrainBackend.starts)
            NeurontrainBackend.starts += 1

    class NeurontrainBackendConfig(BackendConfig):
        @property
        def backend_cls(self) -> type:
            return NeurontrainBackend

    return NeurontrainBackend, NeurontrainBackendConfig


def ray_worker(config: dict) -> None:
    """One Ray Train worker: the torchrun worker's entry, with the data service's batches where served."""
    import ray.train  # lazy: runs inside a Ray Train worker

    summary = train_as_worker(
        config["recipe"],
        Path(config["output_dir"]),
        preflight_check=config["preflight"],
        init_from=config["init_from"],
        service=config["served"],
    )
    ray.train.report(summary.console() if ray.train.get_context().get_world_rank() == 0 else {})


def train_on_ray(
    recipe: Recipe,
    output_dir: Path,
    topology: Topology,
    *,
    preflight_check: bool,
    init_from: InitialCheckpoint | None,
    local_sizes: dict[str, int] | None,
) -> dict:
    """Train `topology.world` workers on the cluster's trainium nodes; returns the main figures of the summary
    (worker 0 reports them to the driver; summary.json is on worker 0's host)."""
    ray = import_ray()
    backend = resolve_backend_name(recipe.runtime.backend)
    world, spec = topology.world, recipe.data.service
    resource = "neuron_cores" if backend == "neuron" else "CPU"
    cluster = join_cluster(spec, local_sizes, world)
    try:
        roles = check_roles(ray.nodes(), spec, world, resource, served=spec.kind == "ray")
        log.info(f"Ray cluster {cluster.address}: {roles}")
        served = _serve(recipe, output_dir) if spec.kind == "ray" else None
        plan = make_plan(recipe, backend, world=world, data=served.lengths if served else None)
        if served is not None:
            _probe(served, plan.collation(0))
        figures = _fit(recipe, output_dir, topology, served, preflight_check, init_from, resource)
        if served is not None:
            where = placement(ray.nodes())
            (output_dir / "data_service").mkdir(parents=True, exist_ok=True)
            (output_dir / "data_service" / "placement.json").write_text(json.dumps(where, indent=1))
            log.info(f"data service: tasks and actors by node role: {where}")
    finally:
        cluster.close()
    return figures


def _serve(recipe: Recipe, output_dir: Path) -> ServedData:
    started = time.perf_counter()
    served = prepare_on_data_nodes(recipe, record_dir=output_dir / "data_service")
    log.info(
        f"data service: {served.lengths.train_samples} training samples tokenized on a data node in "
        f"{time.perf_counter() - started:.1f} s"
    )
    return served


def _probe(served: ServedData, collation: Any) -> None:
    """Pull the first batch once before any worker starts: a data side that cannot make batches fails here,
    not in every worker (and Ray Data's own helper actors start on this node, a data node)."""
    started = time.perf_counter()
    probe = ServedData(served.ids, served.lengths, served.spec, record_dir=None).source_for(collation)
    next(iter(probe(0, 1)))
    log.info(f"data service: first batch in {time.perf_counter() - started:.1f} s")


def _fit(
    recipe: Recipe,
    output_dir: Path,
    topology: Topology,
    served: ServedData | None,
    preflight_check: bool,
    init_from: InitialCheckpoint | None,
    resource: str,
) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig  # lazy: the optional extra
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer  # lazy: the optional extra

    _, config_cls = _backend_classes()
    spec = recipe.data.service
    trainer = DataParallelTrainer(
        ray_worker,
        train_loop_config={
            "recipe": recipe,
            "output_dir": str(output_dir.resolve()),
            "preflight": preflight_check,
            "init_from": init_from,
            "served": served,
        },
        backend_config=config_cls(),
        scaling_config=ScalingConfig(
            num_workers=topology.world,
            label_selector=selector(spec.train_label),
            resources_per_worker={resource: 1},
        ),
        run_config=RunConfig(
            name=recipe.name,
            storage_path=str((output_dir / "ray").resolve()),
            failure_config=FailureConfig(max_failures=topology.max_restarts),
        ),
    )
    try:
        return dict(trainer.fit().metrics or {})
    except Exception as exc:  # Ray Train's TrainingFailedError wraps the worker's error
        raise RuntimeError(f"the Ray Train workers failed: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def check_ray_options(recipe: Recipe, launcher: str, local_cluster: str | None) -> None:
    if recipe.data.service.kind == "ray" and launcher != "ray":
        raise UsageError("data.service.kind ray feeds workers that Ray starts: add --launcher ray")
    if local_cluster is not None and launcher != "ray":
        raise UsageError("--local-cluster starts a Ray cluster for --launcher ray")
