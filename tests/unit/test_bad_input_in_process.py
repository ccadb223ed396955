"""Bad input, in process: exit 2 and one readable line on stderr (the real-process path is checked by
tests/integration/test_bad_input.py)."""

import sys
from pathlib import Path

import pytest
import yaml
from bad_input import DELETE, assert_one_line_usage_error, mutate
from conftest import RECIPES, cli_in_process

RECIPE_CASES = {
    "unknown top-level key": (mutate("trainer", {"x": 1}), "trainer: unknown key"),
    "unknown nested key": (mutate("train.learning_rate", 0.1), "train.learning_rate: unknown key"),
    "wrong type": (mutate("train.max_steps", "many"), "train.max_steps"),
    "negative batch size": (mutate("data.batch_size", -4), "data.batch_size"),
    "zero grad accumulation": (mutate("train.grad_accum", 0), "train.grad_accum"),
    "negative lr": (mutate("train.optimizer.lr", -1.0), "train.optimizer.lr"),
    "unknown task": (mutate("task", "translation"), "task"),
    "unknown backend": (mutate("runtime.backend", "tpu-v9"), "runtime.backend"),
    "buckets not increasing": (mutate("data.buckets", [64, 32]), "strictly increasing"),
    "bucket above max length": (mutate("data.buckets", [32, 512]), "exceeds data.max_length"),
    "missing required section": (mutate("train", DELETE), "train: required key is missing"),
    "model without source": (mutate("model", {"num_labels": 2}), "exactly one of model.pretrained"),
    "unknown precision": (mutate("train.precision", "fp8"), "train.precision"),
    "bad overlong policy": (mutate("data.overlong", "wrap"), "data.overlong"),
    "file source without path": (mutate("data.source", "json"), "data.path is required"),
    "warmup longer than run": (mutate("train.schedule.warmup_steps", 1000), "warmup_steps must be smaller"),
    "unknown packing mode": (mutate("data.packing", "sometimes"), "data.packing"),
    "no room for a document": (mutate("data.max_docs_per_row", 0), "data.max_docs_per_row"),
    "packing an unsupported model": (
        mutate("data.packing", "on").replace("model_type: bert", "model_type: deberta-v2"),
        "data.packing: on: deberta-v2 does not honour a 4D additive attention mask",
    ),
    "not yaml": ("name: [unclosed\n", "not valid YAML"),
    "not a mapping": ("- a\n- b\n", "top level must be a mapping"),
    "empty recipe": ("", "empty"),
}


class _Result:
    def __init__(self, code: int, err: str) -> None:
        self.returncode, self.stderr = code, err


@pytest.fixture
def cli(capsys):
    """`neurontrain ARGS` in this process, as (returncode, stderr)."""

    def run(*args: str) -> _Result:
        code, _, err = cli_in_process(capsys, *args)
        return _Result(code, err)

    return run


@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
def test_malformed_recipe(tmp_path: Path, case: str, cli):
    text, expected = RECIPE_CASES[case]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    assert_one_line_usage_error(cli("run", str(recipe), "--dry-run"), expected)


SET_CASES = {
    "no equals sign": (["--set", "train.max_steps"], "expected KEY.PATH=VALUE"),
    "empty key": (["--set", "=3"], "expected KEY.PATH=VALUE"),
    "empty path segment": (["--set", "train..max_steps=3"], "expected KEY.PATH=VALUE"),
    "unknown key": (["--set", "train.max_stepz=3"], "train.max_stepz: unknown key"),
    "wrong value type": (["--set", "train.max_steps=abc"], "train.max_steps"),
    "into a scalar": (["--set", "train.max_steps.x=1"], "train.max_steps is not a mapping"),
    "invalid yaml value": (["--set", "data.buckets=[1,"], "not valid YAML"),
}


@pytest.mark.parametrize("case", sorted(SET_CASES))
def test_bad_set_expression(case: str, cli):
    args, expected = SET_CASES[case]
    result = cli("run", str(RECIPES / "tiny-bert-classification.yaml"), "--dry-run", *args)
    assert_one_line_usage_error(result, expected)


def test_missing_recipe_file(tmp_path: Path, cli):
    assert_one_line_usage_error(cli("run", str(tmp_path / "nope.yaml")), "recipe not found")


def test_recipe_is_a_directory(tmp_path: Path, cli):
    assert_one_line_usage_error(cli("run", str(tmp_path)), "recipe is not a file")


def test_output_dir_is_a_file(tmp_path: Path, cli):
    target = tmp_path / "file"
    target.write_text("x")
    result = cli("run", str(RECIPES / "tiny-bert-classification.yaml"), "--output-dir", str(target))
    assert_one_line_usage_error(result, "is not a directory")


def test_missing_data_file(tmp_path: Path, cli):
    recipe = yaml.safe_load(mutate("data.source", "json"))
    recipe["data"]["path"] = str(tmp_path / "missing.jsonl")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert_one_line_usage_error(cli("run", str(tmp_path / "r.yaml"), "--dry-run"), "data.path not found")


def test_missing_text_field_and_bad_labels(tmp_path: Path, cli):
    data = tmp_path / "d.jsonl"
    data.write_text('{"review": "good", "label": 1}\n{"review": "bad", "label": 0}\n')
    recipe = yaml.safe_load(mutate("data.source", "json"))
    recipe["data"]["path"] = str(data)
    recipe["data"]["eval_samples"] = 0
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert_one_line_usage_error(cli("run", str(tmp_path / "r.yaml"), "--dry-run"), "'content' is not a column")
    data.write_text('{"content": "good", "label": 7}\n{"content": "bad", "label": 0}\n')
    assert_one_line_usage_error(cli("run", str(tmp_path / "r.yaml"), "--dry-run"), "label 7 of sample 0")


def test_overlong_fail_policy(cli):
    result = cli(
        "run",
        str(RECIPES / "tiny-bert-classification.yaml"),
        "--dry-run",
        "--set",
        "data.overlong=fail",
        "--set",
        "data.max_length=32",
        "--set",
        "data.buckets=max",
    )
    assert_one_line_usage_error(result, "more than data.max_length 32")


def test_fewer_samples_than_one_batch(tmp_path: Path, cli):
    data = tmp_path / "d.jsonl"
    data.write_text('{"content": "good", "label": 1}\n{"content": "bad", "label": 0}\n')
    recipe = yaml.safe_load(mutate("data.source", "json"))
    recipe["data"].update(path=str(data), eval_samples=0)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert_one_line_usage_error(cli("run", str(tmp_path / "r.yaml"), "--dry-run"), "yields no batch")


def test_precompile_and_cache_usage_errors(tmp_path: Path, cli):
    tiny = str(RECIPES / "tiny-bert-classification.yaml")
    assert_one_line_usage_error(cli("precompile", tiny, "--workers", "0"), "--workers must be at least 1")
    assert_one_line_usage_error(cli("precompile", str(tmp_path / "nope.yaml")), "nope.yaml")
    assert_one_line_usage_error(cli("precompile", tiny, "--cache", "ftp://x/y"), "bad cache URL")
    # no Neuron runtime (libneuronxla) importable here
    assert_one_line_usage_error(
        cli("precompile", tiny, "--target", "neuron", "--cache", str(tmp_path)),
        "--target neuron needs the Neuron runtime",
    )
    assert_one_line_usage_error(cli("cache"), "cache needs a command")
    assert_one_line_usage_error(cli("cache", "prune", "--older-than", "soon", "--cache", str(tmp_path)), "bad duration")
    assert_one_line_usage_error(cli("cache", "status", str(tmp_path / "missing.yaml")), "missing.yaml")


def test_precompile_refuses_tensor_parallel(tmp_path: Path, cli, monkeypatch):
    monkeypatch.syspath_prepend(str(RECIPES.parent / "tests" / "standin" / "nxd"))  # NxD's interface, for the plan
    tp2 = ["--nproc-per-node", "2", "--set", "parallel.tp=2", "--cache", str(tmp_path)]
    try:
        assert_one_line_usage_error(
            cli("precompile", str(RECIPES / "tiny-llama-clm.yaml"), *tp2), "one process cannot trace"
        )
    finally:  # later tests must not find the stand-in imported
        for name in [m for m in sys.modules if m.split(".")[0] == "neuronx_distributed"]:
            del sys.modules[name]


def test_hub_kernels_off_cuda(cli):
    """Hub kernels are downloaded CUDA code: asked for on XLA (or a host without CUDA) the run is refused before
    any data is prepared; by default they stay off on every backend (tests/integration/test_recipes_shipped.py)."""
    result = cli("run", str(RECIPES / "tiny-bert-classification.yaml"), "--dry-run", "--set", "model.hub_kernels=true")
    assert_one_line_usage_error(result, "model.hub_kernels: Hugging Face hub kernels run on CUDA only")
