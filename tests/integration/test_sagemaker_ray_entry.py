"""The entry script of a heterogeneous SageMaker job on two "hosts" of this machine (127.0.0.1 in the data group,
localhost in the trainium group), each with its own resourceconfig.json: real `ray start` nodes, the head's
driver replaced by a stand-in that looks at the cluster it is given (and leaves a run where worker 0 would), then
every host torn down and the run published from the host that holds it."""

import json
import threading
from pathlib import Path

from conftest import RECIPES, _free_port

from neurontrain.launch.ray_hosts import marker_path
from neurontrain.launch.sagemaker import recipe_hyperparameters
from neurontrain.launch.sagemaker_entry import main
from neurontrain.launch.sagemaker_groups import with_groups
from neurontrain.recipe import load_recipe

HOSTS = {"data": "127.0.0.1", "trainium": "localhost"}


def _resource_config(root: Path, host: str, group: str, spelling: str) -> Path:
    config = root / host / "input" / "config"
    config.mkdir(parents=True)
    groups = [
        {"instance_group_name": "data", "instance_type": "ml.c5.xlarge", "hosts": [HOSTS["data"]]},
        {"instance_group_name": "trainium", "instance_type": "ml.trn1.2xlarge", "hosts": [HOSTS["trainium"]]},
    ]
    config.joinpath("resourceconfig.json").write_text(
        json.dumps({"current_host": host, spelling: group, "hosts": list(HOSTS.values()), "instance_groups": groups})
    )
    return root / host


def _ray_processes(port: int) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"{port}".encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_heterogeneous_hosts_take_their_roles_and_every_host_is_torn_down(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # as the job's environment sets it
    recipe = load_recipe(str(RECIPES / "tiny-llama-clm.yaml"), []).model_dump(mode="json")
    recipe = with_groups(recipe, ("ml.c5.xlarge", 1), ("ml.trn1.2xlarge", 1))
    hps = {k: json.loads(v) for k, v in recipe_hyperparameters(recipe).items()}  # decoded, as the toolkit does
    port = _free_port()
    common = {
        "SM_HPS": json.dumps(hps),
        "SM_HOSTS": json.dumps(list(HOSTS.values())),
        "NEURONTRAIN_RAY_PORT": str(port),
        "NEURONTRAIN_RAY_START_ARGS": f"--num-cpus 1 --dashboard-port {_free_port()}",
        "NEURONTRAIN_NPROC_PER_NODE": "2",
    }
    envs = {
        # SageMaker writes current_group_name; the toolkit's local mode current_instance_group: one each
        role: {
            **common,
            "SM_CURRENT_HOST": host,
            "SM_MODEL_DIR": str(tmp_path / host / "model"),
            "SM_OUTPUT_DATA_DIR": str(tmp_path / host / "output-data"),
            "SAGEMAKER_BASE_DIR": str(_resource_config(tmp_path, host, role, spelling)),
        }
        for (role, host), spelling in zip(HOSTS.items(), ("current_group_name", "current_instance_group"))
    }
    seen: dict = {}

    def driver(argv: list[str], env: dict) -> int:
        import ray

        seen["argv"], seen["address"] = argv, env["RAY_ADDRESS"]
        run = tmp_path / HOSTS["trainium"] / "checkpoints"  # worker 0 writes the run on its Trainium host
        (run / "model").mkdir(parents=True)
        (run / "model" / "model.safetensors").write_bytes(b"weights")
        (run / "summary.json").write_text("{}")
        ray.init(address=env["RAY_ADDRESS"], logging_level="ERROR")
        try:
            seen["nodes"] = sorted(
                (n["Labels"]["neurontrain-role"], n["Labels"]["neurontrain-host"]) for n in ray.nodes() if n["Alive"]
            )
        finally:
            ray.shutdown()
        return 0

    codes: dict = {}
    member = threading.Thread(target=lambda: codes.update(member=main(envs["trainium"])))
    member.start()
    codes["head"] = main(envs["data"], runner=driver)
    member.join(timeout=120)
    assert not member.is_alive() and codes == {"head": 0, "member": 0}
    assert seen["address"] == f"127.0.0.1:{port}"
    assert seen["nodes"] == [("data", "127.0.0.1"), ("trainium", "localhost")]
    argv = seen["argv"]
    assert argv[argv.index("--launcher") + 1] == "ray" and argv[argv.index("--nnodes") + 1] == "1"
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert not _ray_processes(port), "a Ray process of the job outlived it"
    assert not marker_path("localhost").exists()
    # the Trainium host that holds worker 0's run publishes it; the head has none
    assert (tmp_path / "localhost" / "model" / "model.safetensors").read_bytes() == b"weights"
    assert (tmp_path / "localhost" / "output-data" / "summary.json").exists()
    assert not (tmp_path / "127.0.0.1" / "model").exists()
