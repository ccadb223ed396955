"""`submit slurm` and `submit sagemaker` without a cluster: the sbatch script, the SageMaker request (botocore's
stubber and a local endpoint), the image table against the published list, the entry script's pieces, and the
one-line errors for bad instance types, regions and buckets. No torch: submit must not need it."""

import json
import re
from pathlib import Path

import pytest
from conftest import DATA, RECIPES, cli_in_process

LLAMA = str(RECIPES / "tiny-llama-clm.yaml")
ROLE = "arn:aws:iam::123456789012:role/Trainer"


def _usage_error(capsys, *args: str) -> str:
    code, _, err = cli_in_process(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and lines and lines[-1].startswith("neurontrain: error:"), err
    assert "Traceback" not in err
    return lines[-1]


# -- Slurm ------------------------------------------------------------------------------------------------------


def test_sbatch_trn2_runs_64_workers_a_node_with_logical_core_config(tmp_path, capsys):
    code, out, _ = cli_in_process(
        capsys,
        "submit",
        "slurm",
        LLAMA,
        "--nodes",
        "2",
        "--instance-type",
        "trn2",
        "-o",
        str(tmp_path),
        "--job-name",
        "t2",
        "--set",
        "data.batch_size=4",
    )
    assert code == 0 and json.loads(out)["workers"] == 128
    script = (tmp_path / "t2.sbatch").read_text()
    assert "--nproc-per-node=64" in script and "export NEURON_LOGICAL_NC_CONFIG=2" in script
    single = tmp_path / "one"
    assert (
        cli_in_process(
            capsys,
            "submit",
            "slurm",
            LLAMA,
            "--nodes",
            "1",
            "--instance-type",
            "trn1.2xlarge",
            "-o",
            str(single),
            "--job-name",
            "s",
        )[0]
        == 0
    )
    assert (
        "--nproc-per-node=2" in (single / "s.sbatch").read_text()
        and "FI_PROVIDER" not in (single / "s.sbatch").read_text()
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--instance-type", "trn1.32xlage"], "is not a Trainium instance type (did you mean trn1.32xlarge?)"),
        (["--instance-type", "trn3"], "is not a Trainium instance type"),
        (["--master-port", "41000"], "Neuron root communicator's port"),
        (["--partition", "a b"], "is not a Slurm name"),
        (["--compile-cache", "s3://Bad_Bucket/x"], "bad S3 bucket name"),
        (
            ["--set", "train.global_batch_size=24", "--nproc-per-node", "2"],
            "train.global_batch_size 24 is not divisible by data.batch_size 8 x 4 workers = 32",
        ),
        (["--set", "data.train_samples=100"], "100 training samples make no global batch of 8 x 64 workers"),
        (["--set", "data.train_samples=40"], "64 workers but only 40 training samples"),
    ],
)
def test_submit_slurm_bad_input_is_one_line_before_any_script(tmp_path, capsys, args, message):
    last = _usage_error(capsys, "submit", "slurm", LLAMA, "--nodes", "2", "-o", str(tmp_path), *args)
    assert message in last, last
    assert not list(tmp_path.glob("*.sbatch"))


# -- SageMaker ----------------------------------------------------------------------------------------------------
def _request(capsys, *args: str) -> dict:
    code, out, err = cli_in_process(
        capsys,
        "submit",
        "sagemaker",
        LLAMA,
        "--role",
        ROLE,
        "--output",
        "s3://my-bucket/jobs",
        "--region",
        "us-west-2",
        "--job-name",
        "tiny-1",
        "--dry-run",
        *args,
    )
    assert code == 0, err
    return json.loads(out)


def test_sagemaker_request_is_valid_for_the_api(capsys):
    """botocore's stubber checks the request against SageMaker's API model; nothing leaves the process."""
    import boto3
    from botocore.stub import Stubber

    request = _request(
        capsys,
        "--instance-count",
        "2",
        "--compile-cache",
        "s3://my-bucket/cache",
        "--input",
        "train=s3://my-data/sets/train.jsonl",
        "--set",
        "data.source=json",
        "--max-retries",
        "2",
    )
    client = boto3.client("sagemaker", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stub:
        stub.add_response(
            "create_training_job", {"TrainingJobArn": "arn:aws:sagemaker:us-west-2:1:training-job/tiny-1"}, request
        )
        assert client.create_training_job(**request)["TrainingJobArn"].endswith("tiny-1")
    hp, env = request["HyperParameters"], request["Environment"]
    assert json.loads(hp["sagemaker_program"]) == "neurontrain_sagemaker_entry.py"
    assert "sagemaker_torch_distributed_enabled" not in hp  # the entry script is each instance's launcher
    assert json.loads(hp["recipe.runtime.compile_cache"]) == "s3://my-bucket/cache"
    assert json.loads(hp["recipe.data.path"]) == "/opt/ml/input/data/train"
    assert "NEURON_COMPILE_CACHE_URL" not in env and env["NEURONTRAIN_CACHE_DIR"].startswith("/tmp/")
    assert env["NEURONTRAIN_NPROC_PER_NODE"] == "32" and env["FI_PROVIDER"] == "efa"
    assert request["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] == "s3://my-data/sets/train.jsonl"
    assert request["RetryStrategy"] == {"MaximumRetryAttempts": 2}
    assert request["CheckpointConfig"] == {
        "S3Uri": "s3://my-bucket/jobs/tiny-1/checkpoints",
        "LocalPath": "/opt/ml/checkpoints",
    }
    assert request["ResourceConfig"]["InstanceCount"] == 2


def test_heterogeneous_request_has_two_groups_and_the_data_channel_on_the_data_group(capsys):
    """--data-instances: ResourceConfig.InstanceGroups (valid for the API: botocore's stubber), the data channel
    limited to the data group, the other channels to every host, no distribution flag, Ray's auth mode set."""
    import boto3
    from botocore.stub import Stubber

    request = _request(
        capsys,
        "--instance-count", "2",
        "--data-instances", "ml.c5.18xlarge:3",
        "--input", "train=s3://my-data/sets/train.jsonl",
        "--input", "model=s3://my-data/models/base",
        "--data-channel", "train",
        "--set", "data.source=json",
    )  # fmt: skip
    client = boto3.client("sagemaker", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stub:
        stub.add_response(
            "create_training_job", {"TrainingJobArn": "arn:aws:sagemaker:us-west-2:1:training-job/tiny-1"}, request
        )
        client.create_training_job(**request)
    assert request["ResourceConfig"] == {
        "InstanceGroups": [
            {"InstanceGroupName": "data", "InstanceType": "ml.c5.18xlarge", "InstanceCount": 3},
            {"InstanceGroupName": "trainium", "InstanceType": "ml.trn1.32xlarge", "InstanceCount": 2},
        ],
        "VolumeSizeInGB": 512,
    }
    sources = {c["ChannelName"]: c["DataSource"]["S3DataSource"] for c in request["InputDataConfig"]}
    assert sources["train"]["InstanceGroupNames"] == ["data"] and "InstanceGroupNames" not in sources["model"]
    hp = request["HyperParameters"]
    assert not any("distribut" in key for key in hp)
    assert json.loads(hp["recipe.data.service.kind"]) == "ray"
    assert [g["role"] for g in json.loads(hp["recipe.cluster.groups"])] == ["data", "trainium"]
    assert request["Environment"]["RAY_AUTH_MODE"] == "disabled"
    assert request["Environment"]["NEURONTRAIN_NPROC_PER_NODE"] == "32"


def test_sbatch_with_data_nodes_splits_the_hosts_and_runs_a_ray_node_on_each(tmp_path, capsys):
    from neurontrain.launch.ray_node import role_from

    code, out, err = cli_in_process(
        capsys, "submit", "slurm", LLAMA, "--nodes", "2", "--data-nodes", "1", "--instance-type", "trn1",
        "-o", str(tmp_path), "--job-name", "het", "--set", "data.batch_size=1",
    )  # fmt: skip
    assert code == 0 and json.loads(out)["workers"] == 64, err
    script = (tmp_path / "het.sbatch").read_text()
    assert "#SBATCH --nodes=3" in script
    assert 'NEURONTRAIN_DATA_HOSTS=$(echo "$hosts" | head -n 1' in script
    assert 'NEURONTRAIN_TRAINIUM_HOSTS=$(echo "$hosts" | tail -n +2' in script
    assert "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=" in script and "umask 077" in script
    node = script[script.index("neurontrain_node() {") :]
    assert '-m neurontrain.launch.ray_node "$SLURMD_NODENAME" -- run' in node
    assert "--set data.service.kind=ray" in node and "--launcher=ray --nnodes=2 --nproc-per-node=32" in node
    env = {"NEURONTRAIN_DATA_HOSTS": "c1", "NEURONTRAIN_TRAINIUM_HOSTS": "t1,t2"}
    env["NEURONTRAIN_HEAD_ADDRESS"] = "10.0.0.1"
    head, member = role_from("c1", env), role_from("t2", env)
    assert head.is_head and head.role == "data" and head.reach == "10.0.0.1"
    assert not member.is_head and member.role == "trainium" and member.hosts == ("c1", "t1", "t2")
    message = _usage_error(
        capsys, "submit", "slurm", "--lightning", "train.py", "--nodes", "1", "--data-nodes", "1", "-o", str(tmp_path)
    )
    assert "--data-nodes" in message


@pytest.mark.parametrize(
    "instance, count, efa, workers",
    [
        ("ml.trn1.32xlarge", 1, False, "32"),
        ("ml.trn1n.32xlarge", 4, True, "32"),
        ("ml.trn2.48xlarge", 2, True, "64"),
        ("ml.trn1.2xlarge", 3, False, "2"),
    ],
)
def test_sagemaker_efa_for_every_multi_node_trainium_type(capsys, instance, count, efa, workers):
    env = _request(capsys, "--instance-type", instance, "--instance-count", str(count), "--set", "data.batch_size=2")[
        "Environment"
    ]
    assert ("FI_PROVIDER" in env) == efa and (env.get("FI_EFA_USE_DEVICE_RDMA") == "1") == efa
    assert env["NEURONTRAIN_NPROC_PER_NODE"] == workers


def test_trainium_instance_table_names_sagemaker_training_types():
    import botocore.session

    from neurontrain.launch.instances import INSTANCES

    enum = set(botocore.session.get_session().get_service_model("sagemaker").shape_for("TrainingInstanceType").enum)
    assert {t.sagemaker_name for t in INSTANCES.values()} <= enum
    assert {t for t in enum if t.startswith("ml.trn")} == {t.sagemaker_name for t in INSTANCES.values()}


def _published() -> tuple[dict[str, str], dict[str, str]]:
    """The recorded published list: tags per SDK release, registry account per region."""
    tags = {}
    for path in sorted((DATA / "dlc").glob("2.9-neuronx-sdk*.yml")):
        text = path.read_text()
        sdk = re.search(r'^sdk: "([0-9.]+)"', text, re.M).group(1)
        tags[sdk] = re.search(r'^  - "([^"]+)"', text, re.M).group(1)
    accounts = dict(
        re.findall(
            r"^\| [^|]+ \| ([a-z]+-[a-z]+-\d) \| (\d{12}) \|$",
            (DATA / "dlc" / "region_availability.md").read_text(),
            re.M,
        )
    )
    return tags, accounts


def test_image_uri_for_every_release_and_region_matches_the_published_list():
    from neurontrain.errors import UsageError
    from neurontrain.launch import dlc

    tags, accounts = _published()
    assert len(tags) >= 5 and len(accounts) >= 30
    assert set(dlc.TAGS) == set(tags) and set(dlc.ACCOUNTS) == set(accounts)
    for sdk, tag in tags.items():
        for region, account in accounts.items():
            if sdk in dlc.NO_XLA_TRAINING:
                with pytest.raises(UsageError, match="no longer supports PyTorch/XLA training"):
                    dlc.image_uri(region, sdk)
                continue
            suffix = ".amazonaws.com.cn" if region.startswith("cn-") else ".amazonaws.com"
            assert dlc.image_uri(region, sdk) == f"{account}.dkr.ecr.{region}{suffix}/pytorch-training-neuronx:{tag}"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--instance-type", "ml.trn1.32xlage"], "(did you mean ml.trn1.32xlarge?)"),
        (["--instance-type", "ml.p4d.24xlarge"], "is not a Trainium instance: the Neuron training image runs on"),
        (
            ["--region", "us-west-22"],
            "--region 'us-west-22' is not an AWS region with Neuron training images (did you mean us-west-2?)",
        ),
        (["--output", "s3://My_Bucket/jobs"], "bad S3 bucket name 'My_Bucket'"),
        (["--output", "s3://ab/jobs"], "bad S3 bucket name 'ab'"),
        (["--output", "s3://my..bucket/jobs"], "no '..'"),
        (["--input", "train=s3://192.168.1.1/x"], "not an IP address"),
        (["--input", "train"], "expected NAME=s3://bucket/prefix"),
        (["--role", "Trainer"], "IAM role ARN"),
        (["--neuron-sdk", "2.30.0"], "Neuron 2.30.0 no longer supports PyTorch/XLA training"),
        (["--neuron-sdk", "2.99.0"], "has no published PyTorch 2.9 training image"),
        (["--set", "data.source=json", "--set", "data.path=train.jsonl"], "upload it to S3 and pass --input train="),
        (["--input", "a=s3://my-data/a", "--input", "b=s3://my-data/b"], "pass --data-channel"),
        (["--compile-cache", "/shared/cache"], "--compile-cache '/shared/cache' must be s3://bucket/prefix"),
    ],
)
def test_submit_sagemaker_bad_input_is_one_line(capsys, args, message):
    base = {"--role": ROLE, "--output": "s3://my-bucket/jobs", "--region": "us-west-2"}
    for i in range(0, len(args) - 1):
        base.pop(args[i], None)
    flat = [x for kv in base.items() for x in kv]
    last = _usage_error(capsys, "submit", "sagemaker", LLAMA, *flat, "--dry-run", *args)
    assert message in last, last


# -- the entry script's pieces ------------------------------------------------------------------------------------
def test_entry_reads_hyperparameters_as_the_toolkit_delivers_them(tmp_path, capsys, monkeypatch):
    """hyperparameters.json as SageMaker writes it -> the toolkit's read_hyperparameters and to_env_vars ->
    SM_HPS -> the recipe, identical to the submitted one."""
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path))
    from sagemaker_training import environment, mapping

    from neurontrain.launch.sagemaker_entry import recipe_from_hyperparameters
    from neurontrain.recipe import load_recipe

    request = _request(capsys, "--set", "data.buckets=[64,128]")
    hp_file = tmp_path / "hyperparameters.json"
    hp_file.write_text(json.dumps(request["HyperParameters"]))
    monkeypatch.setattr(environment, "hyperparameters_file_dir", str(hp_file))
    decoded = environment.read_hyperparameters()
    assert decoded["recipe.name"] == "tiny-llama-clm" and decoded["recipe.data.buckets"] == [64, 128]
    sm_hps = mapping.to_env_vars({"hps": decoded})["SM_HPS"]
    recipe = recipe_from_hyperparameters(json.loads(sm_hps))
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    assert load_recipe(path).fingerprint() == load_recipe(LLAMA, ["data.buckets=[64,128]"]).fingerprint()


def test_entry_maps_channels_and_builds_the_static_rendezvous(tmp_path):
    from neurontrain.errors import UsageError
    from neurontrain.launch.sagemaker_entry import map_channels, run_argv

    train = tmp_path / "train"
    train.mkdir()
    (train / "part.jsonl").write_text("{}\n")
    recipe = {"data": {"path": "/opt/ml/input/data/train"}, "model": {"pretrained": None}}
    assert map_channels(recipe, {"train": str(train)})["data"]["path"] == str(train / "part.jsonl")
    (train / "more.jsonl").write_text("{}\n")
    with pytest.raises(UsageError, match="holds 2 files"):
        map_channels({"data": {"path": "/opt/ml/input/data/train"}}, {"train": str(train)})
    with pytest.raises(UsageError, match="names channel 'eval'"):
        map_channels({"data": {"path": "/opt/ml/input/data/eval/x.jsonl"}}, {"train": str(train)})
    argv = run_argv("r.json", "/opt/ml/checkpoints", ["algo-1", "algo-2", "algo-3"], "algo-3", 32)
    assert argv[argv.index("--node-rank") + 1] == "2" and argv[argv.index("--master-addr") + 1] == "algo-1"
    assert argv[argv.index("--nnodes") + 1] == "3" and argv[argv.index("--nproc-per-node") + 1] == "32"
    assert "--nnodes" not in run_argv("r.json", "/o", ["algo-1"], "algo-1", 2)


def test_entry_publishes_the_model_and_prints_metric_lines(tmp_path, capsys):
    from neurontrain.launch.sagemaker import METRICS
    from neurontrain.launch.sagemaker_entry import main as entry

    base, seen = tmp_path / "ml", []

    def fake_run(argv: list[str]) -> int:
        seen.append(argv)
        out = Path(argv[argv.index("--output-dir") + 1])
        (out / "model").mkdir(parents=True)
        (out / "model" / "config.json").write_text("{}")
        records = [{"step": 1, "loss": 2.5, "lr": 0.1, "tokens_per_second": 10.0}, {"step": 1, "eval_loss": 2.25}]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (out / "summary.json").write_text(json.dumps({"final_loss": 2.5}))
        print(json.dumps({"final_loss": 2.5}))
        return 0

    env = {
        "SM_HPS": json.dumps({"recipe.name": "x", "recipe.data.path": None}),
        "SM_HOSTS": '["algo-1"]',
        "SM_CURRENT_HOST": "algo-1",
        "SAGEMAKER_BASE_DIR": str(base),
        "SM_MODEL_DIR": str(base / "model"),
        "SM_OUTPUT_DATA_DIR": str(base / "output" / "data"),
        "NEURONTRAIN_NPROC_PER_NODE": "2",
    }
    assert entry(env, fake_run) == 0
    assert seen[0][:2] == ["run", str(base / "checkpoints" / "sagemaker-recipe.json")]
    assert (base / "model" / "config.json").is_file() and (base / "output" / "data" / "summary.json").is_file()
    log = capsys.readouterr().out
    for metric in METRICS:
        assert [float(m.group(1)) for m in re.finditer(metric["Regex"], log)], metric["Name"]
    assert [float(m.group(1)) for m in re.finditer(METRICS[0]["Regex"], log)] == [2.5]  # not the eval loss
    assert entry({"SM_HOSTS": '["algo-1"]'}, fake_run) == 2


# -- Lightning jobs ---------------------------------------------------------------------------------------------
def test_a_lightning_job_ships_its_script_folder_and_runs_it_on_every_instance(tmp_path, capsys):
    import io
    import tarfile

    from neurontrain.launch import sagemaker_entry
    from neurontrain.launch.sagemaker import LIGHTNING_HP, source_tarball

    folder = tmp_path / "project"
    (folder / "pkg" / "__pycache__").mkdir(parents=True)
    (folder / "train.py").write_text("print('hi')\n")
    (folder / "pkg" / "model.py").write_text("X = 1\n")
    (folder / "pkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref\n")
    code, out, err = cli_in_process(
        capsys, "submit", "sagemaker", "--lightning", f"{folder / 'train.py'} --max-steps 5", "--role", ROLE,
        "--output", "s3://my-bucket/jobs", "--region", "us-west-2", "--instance-count", "2", "--dry-run",
    )  # fmt: skip
    assert code == 0, err
    request = json.loads(out)
    assert json.loads(request["HyperParameters"][LIGHTNING_HP]) == "train.py --max-steps 5"
    assert request["AlgorithmSpecification"]["MetricDefinitions"] == []
    with tarfile.open(fileobj=io.BytesIO(source_tarball(folder))) as tar:
        names = set(tar.getnames())
        requirements = tar.extractfile("requirements.txt").read().decode()
    assert {"lightning_source/train.py", "lightning_source/pkg/model.py"} <= names
    assert not any("__pycache__" in n or ".git" in n for n in names) and "lightning" in requirements

    code_dir = tmp_path / "code"
    (code_dir / "lightning_source").mkdir(parents=True)
    (code_dir / "lightning_source" / "train.py").write_text("")
    seen = {}

    def runner(argv, cwd=None):
        seen.update(argv=argv, cwd=cwd)
        return 0

    env = {
        "SM_HPS": json.dumps({LIGHTNING_HP: "train.py --max-steps 5"}),
        "SM_HOSTS": '["algo-1", "algo-2"]',
        "SM_CURRENT_HOST": "algo-2",
        "SAGEMAKER_BASE_DIR": str(tmp_path / "ml"),
        "NEURONTRAIN_NPROC_PER_NODE": "32",
    }
    original = sagemaker_entry.PACKAGE_PARENT
    sagemaker_entry.PACKAGE_PARENT = code_dir
    try:
        assert sagemaker_entry.main(env, runner) == 0
        assert seen["argv"][:3] == ["run", "--lightning", f"{code_dir / 'lightning_source' / 'train.py'} --max-steps 5"]
        assert (
            seen["argv"][seen["argv"].index("--node-rank") + 1] == "1"
            and seen["cwd"] == tmp_path / "ml" / "checkpoints"
        )
        bad = {**env, "SM_HPS": json.dumps({LIGHTNING_HP: "missing.py"})}
        assert sagemaker_entry.main(bad, runner) == 2
        assert "missing.py is not in the job's source" in capsys.readouterr().err
    finally:
        sagemaker_entry.PACKAGE_PARENT = original
