"""`checkpoint migrate --layout optimum-neuron` against optimum-neuron 0.4.5's own code, through fixtures it made
(tests/fixtures/optimum_neuron/make_fixtures.py says how): its consolidation turned neurontrain's output back into
the source bit for bit, for a GQA Llama at TP 2 (KV = TP) and TP 8 (KV < TP, plain and fused) and every family the
layout takes; and a directory it laid out (its own HF->rank code, xser) comes back through `--to gpu` EQUAL."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import cli_in_process

from neurontrain.checkpoint.migrate import MigrateOptions, migrate
from neurontrain.checkpoint.xser import XserFile, save_xser
from neurontrain.errors import UsageError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "optimum_neuron"
_spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
make_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixtures)
RECORD = json.loads((FIXTURES / "cases.json").read_text())
CASES = RECORD["cases"]
WRITTEN = [name for name, case in CASES.items() if "refused" not in case]
REFUSED = [name for name, case in CASES.items() if "refused" in case]


@pytest.fixture(scope="module")
def migrated(tmp_path_factory):
    """name -> (the case's seeded source, regenerated; neurontrain's --layout optimum-neuron output of it), made
    once per module (a test that changes the output works on a copy)."""
    made = {}

    def make(name: str) -> tuple[Path, Path]:
        if name not in made:
            case, base = CASES[name], tmp_path_factory.mktemp(name)
            make_fixtures.write_source(case, base / "hf")
            fuse = case.get("fuse_qkv", False)
            migrate(
                base / "hf",
                base / "neuron",
                MigrateOptions(to="neuron", tp=case["tp"], layout="optimum-neuron", fuse_qkv=fuse),
            )
            made[name] = base / "hf", base / "neuron"
        return made[name]

    return make


def recorded_differences(case: dict, out: Path) -> list[str]:
    """What differs between the output and what optimum-neuron consolidated when the fixture was made."""
    differences = []
    model = out / "shards" / "model"
    files = sorted(p.name for p in model.glob("dp_rank_*_pp_rank_??.pt"))
    if files != sorted(case["rank_files"]):
        return [f"rank files {files} != {sorted(case['rank_files'])}"]
    for name, expected in case["rank_files"].items():
        tensors = XserFile(model / name)
        found = make_fixtures.digest([(n, make_fixtures.sha(tensors[n])) for n in tensors])
        if found != expected:
            differences.append(f"{name}: its tensors differ from those optimum-neuron consolidated")
    for name, expected in case["metadata"].items():
        if make_fixtures.digest(json.loads((out / "shards" / name).read_text())) != expected:
            differences.append(f"{name} differs from the metadata optimum-neuron consolidated with")
    return differences


@pytest.mark.parametrize("name", WRITTEN)
def test_optimum_neuron_consolidated_every_case_into_its_source(name):
    """The record: optimum-neuron's consolidation gave back every tensor of the seeded source, bit for bit."""
    case = CASES[name]
    assert case["consolidated_bit_identical"]
    source = make_fixtures.seeded_tensors(case["shapes"])
    assert sorted(case["consolidated"]) == sorted(case["model_names"])  # none dropped
    for model_name, key in case["model_names"].items():
        assert case["consolidated"][model_name] == make_fixtures.sha(source[key]), model_name


# a GQA Llama at KV = TP (separate q/k/v), KV < TP (GQAQKVColumnParallelLinear, plain and fused), q/k/v biases and
# a hand-ruled encoder (the script checks every case at fixture time; the record test above covers them all)
REBUILT = ["llama-gqa-tp2", "llama-gqa-tp8", "llama-gqa-tp8-fused", "qwen2-tp2", "bert-tp2"]


@pytest.mark.parametrize("name", REBUILT)
def test_the_output_is_still_the_one_optimum_neuron_consolidated(migrated, name):
    _, out = migrated(name)
    assert recorded_differences(CASES[name], out) == []
    assert (out / "shards" / "done").read_text() == "1" and (out / "shards" / "checkpoint").read_text() == "1"


def test_the_recorded_check_fails_on_a_dropped_or_permuted_tensor(tmp_path, migrated):
    case, out = CASES["llama-gqa-tp8"], tmp_path / "neuron"
    shutil.copytree(migrated("llama-gqa-tp8")[1], out)
    model = out / "shards" / "model"
    first, second = (model / f"dp_rank_00_tp_rank_0{r}_pp_rank_00.pt.tensors" for r in (0, 1))
    shutil.copy(first / "tensor_3.pt", tmp_path / "kept.pt")
    shutil.copy(second / "tensor_3.pt", first / "tensor_3.pt")  # rank 1's piece in rank 0's place
    assert any("tp_rank_00" in d for d in recorded_differences(case, out))
    shutil.copy(tmp_path / "kept.pt", first / "tensor_3.pt")
    assert recorded_differences(case, out) == []
    metadata = out / "shards" / "mp_metadata_pp_rank_0.json"
    data = json.loads(metadata.read_text())
    del data["parameters"]["model.layers.1.mlp.down_proj.weight"]  # consolidation would drop it silently
    metadata.write_text(json.dumps(data, indent=4))
    assert any("mp_metadata" in d for d in recorded_differences(case, out))


def _experts_in_tp_plan() -> bool:
    import transformers  # lazy: seconds to import

    return "layers.*.mlp.experts.gate_up_proj" in transformers.MixtralConfig.base_model_tp_plan


@pytest.mark.parametrize("name", REFUSED)
def test_what_optimum_neurons_consolidation_cannot_rebuild_is_refused(tmp_path, name):
    case = CASES[name]
    make_fixtures.write_source(case, tmp_path / "hf")
    if "experts.gate_up_proj" in case["refused"] and not _experts_in_tp_plan():
        # recorded with transformers 5.24, whose plan split Mixtral's experts; from 5.25 tensor parallel replicates
        # them (base_model_ep_plan only), so nothing packed is left to refuse: the experts go to every rank whole
        migrate(tmp_path / "hf", tmp_path / "out", MigrateOptions(to="neuron", tp=case["tp"], layout="optimum-neuron"))
        assert (tmp_path / "out" / "shards" / "mp_metadata_pp_rank_0.json").exists()
        return
    with pytest.raises(UsageError) as refusal:
        migrate(tmp_path / "hf", tmp_path / "out", MigrateOptions(to="neuron", tp=case["tp"], layout="optimum-neuron"))
    assert str(refusal.value) == case["refused"] and not (tmp_path / "out").exists()


def test_the_metadata_is_what_optimum_neurons_own_spec_classes_serialize(migrated):
    """xser_llama_tp4's metadata was built by optimum-neuron's FusedLinearsSpec / GQAQKVColumnParallelLinearSpec
    from the arguments its Llama passes them, and NxD's layers' attributes."""
    _, out = migrated("llama-small-tp4")
    ours = json.loads((out / "shards" / "mp_metadata_pp_rank_0.json").read_text())
    theirs = json.loads((FIXTURES / "xser_llama_tp4" / "shards" / "mp_metadata_pp_rank_0.json").read_text())
    assert ours == theirs and list(ours["parameters"]) == list(theirs["parameters"])


def test_a_directory_optimum_neuron_laid_out_in_xser_comes_back_equal(tmp_path, capsys, migrated):
    src, back = migrated("llama-small-tp4")[0], tmp_path / "back"
    code, out, err = cli_in_process(capsys, "checkpoint", "inspect", str(FIXTURES / "xser_llama_tp4"), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["layout"] == "optimum-neuron" and "xser" in report["writer"]
    assert report["sharding"] == {"tp": 4, "pp": 1} and report["tensors"] == 21
    code, out, err = cli_in_process(
        capsys, "checkpoint", "migrate", str(FIXTURES / "xser_llama_tp4"), str(back), "--to", "gpu"
    )
    assert code == 0, err
    code, out, err = cli_in_process(capsys, "checkpoint", "verify", str(src), str(back))
    assert code == 0 and out.rstrip().endswith("EQUAL"), out + err
    code, out, err = cli_in_process(capsys, "checkpoint", "verify", str(src), str(FIXTURES / "xser_llama_tp4"))
    assert code == 0 and out.rstrip().endswith("EQUAL"), out + err


def test_a_rank_file_lacking_a_listed_tensor_is_refused_naming_it(tmp_path, capsys):
    shards = tmp_path / "copy"
    shutil.copytree(FIXTURES / "xser_llama_tp4", shards)
    rank = shards / "shards" / "model" / "dp_rank_00_tp_rank_02_pp_rank_00.pt"
    refs = XserFile(rank)
    kept = {n: refs[n].clone() for n in refs if n != "model.layers.0.mlp.down_proj.weight"}
    shutil.rmtree(rank.parent / (rank.name + ".tensors"))
    save_xser(kept, rank)
    code, _, err = cli_in_process(capsys, "checkpoint", "migrate", str(shards), str(tmp_path / "back"), "--to", "gpu")
    assert code == 2 and "lacks model.layers.0.mlp.down_proj.weight" in err and err.count("\n") == 1


def test_run_init_from_takes_a_directory_optimum_neuron_laid_out(migrated):
    import transformers

    from neurontrain.checkpoint.initial import load_initial_weights

    src, _ = migrated("llama-small-tp4")
    config = transformers.AutoConfig.from_pretrained(src)
    model = transformers.AutoModelForCausalLM.from_config(config)
    source = load_initial_weights(model, FIXTURES / "xser_llama_tp4")
    expected = make_fixtures.seeded_tensors(CASES["llama-small-tp4"]["shapes"])
    state = model.state_dict()
    assert "optimum-neuron" in source.description
    assert all(torch.equal(state[n], expected[n]) for n in expected)


def test_xser_shards_are_read_a_tensor_at_a_time(monkeypatch):
    """A tensor of an xser checkpoint reads only its own tensor files, one per rank, memory-mapped; past the read
    budget the files are let go (mapped.py), as for plain rank files: the memory bound of `--to gpu` holds."""
    import neurontrain.checkpoint.xser as xser_module
    from neurontrain.checkpoint.optimum_neuron import OptimumNeuronReader

    loads = []
    real_load = xser_module.load_torch_file
    monkeypatch.setattr(xser_module, "load_torch_file", lambda path: (loads.append(path), real_load(path))[1])
    reader = OptimumNeuronReader(FIXTURES / "xser_llama_tp4" / "shards")
    assert loads == []
    shape, _ = reader.meta("model.layers.1.mlp.up_proj.weight")  # meta reads the pieces' shapes, mapped
    reader.get("model.layers.1.mlp.up_proj.weight")
    assert len(loads) == 4 and len({p.parent.name for p in loads}) == 4  # the fused gate_up piece of each rank
    assert shape == (64, 32)
    reader.get("model.layers.1.self_attn.k_proj.weight")
    assert len(loads) == 8 and all(p.name.startswith("tensor_") for p in loads)


# TrainingNeuronConfig's fields in optimum-neuron 0.4.5 (models/training/config.py), in order: its save_pretrained
# writes json.dumps(asdict(trn_config), indent=4) as trn_config.json beside config.json
TRN_CONFIG_FIELDS = [
    "tensor_parallel_size", "sequence_parallel_enabled", "kv_size_multiplier", "pipeline_parallel_size",
    "virtual_pipeline_parallel_size", "pipeline_parallel_num_microbatches", "pipeline_parallel_use_zero1_optimizer",
    "gradient_checkpointing", "checkpoint_dir", "num_local_ranks_per_step", "use_xser", "async_save", "fuse_qkv",
    "recompute_causal_mask", "transpose_nki_inputs",
]  # fmt: skip


def test_trn_config_is_written_and_a_family_it_cannot_train_is_said_in_one_line(tmp_path, capsys, migrated):
    _, fused = migrated("llama-gqa-tp8-fused")
    written = (fused / "trn_config.json").read_text()
    trn = json.loads(written)
    assert list(trn) == TRN_CONFIG_FIELDS and written == json.dumps(trn, indent=4)
    assert (trn["tensor_parallel_size"], trn["pipeline_parallel_size"], trn["use_xser"], trn["fuse_qkv"]) == (
        8, 1, True, True,
    )  # fmt: skip
    hf, _ = migrated("mistral-tp2")
    capsys.readouterr()  # the fixture's own migration said it too
    args = ("checkpoint", "migrate", str(hf), str(tmp_path / "m"), "--to", "neuron", "--tp", "2")
    code, out, err = cli_in_process(capsys, *args, "--layout", "optimum-neuron", "--no-xser")
    said = [line for line in err.splitlines() if "no training model for mistral" in line]
    assert code == 0 and len(said) == 1 and "(only llama, granite, qwen3)" in said[0], err
    assert json.loads(out)["note"] in said[0]
    assert json.loads((tmp_path / "m" / "trn_config.json").read_text())["use_xser"] is False
    code, out, err = cli_in_process(capsys, "checkpoint", "migrate", str(hf), str(tmp_path / "n"), "--to", "neuron")
    assert code == 0 and "note" not in json.loads(out) and not (tmp_path / "n" / "trn_config.json").exists()
