"""The memory planner against live XLA:CPU tensors, through `run --dry-run` on a Llama-3.2-1B-shaped config,
and its refusal. The dry runs stay in the test process: a dry run never starts torch-xla's runtime."""

import json
import os
import subprocess
import sys

from conftest import RECIPES, REPO, cli_in_process

# In one fresh process: each tiny recipe's plan, then its model, gradients and AdamW state on the XLA device as
# the trainer creates them; prints the planner's bytes beside the bytes of the live device tensors.
LIVE_BYTES = """
import json, sys
import torch
import torch_xla
from neurontrain.model.build import build_model
from neurontrain.loop.optim import build_optimizer, materialize_optimizer_state
from neurontrain.plan.planning import make_plan
from neurontrain.recipe import load_recipe

def device_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "xla")

out = {}
for path in sys.argv[1:]:
    plan = make_plan(load_recipe(path), "xla-cpu")
    model = build_model(plan.recipe, plan.config).to(torch_xla.device())
    optimizer = build_optimizer(plan.recipe, model)
    materialize_optimizer_state(optimizer)
    torch_xla.sync()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    live = {
        "parameters": device_bytes(model.parameters()),
        "gradients": device_bytes(p.grad for p in model.parameters()),
        "optimizer": device_bytes(state),
    }
    choice = plan.memory.describe()["choice"]
    out[plan.recipe.name] = {"planned": plan.memory.choice.bytes, "live": live, "config": choice}
print(json.dumps(out))
"""

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 128256,
}
OFFLINE = ["--set", "tokenizer.pretrained=null", "--set", "tokenizer.word_level.vocab_size=2000"]
OFFLINE += ["--set", "data.source=synthetic-text", "--set", "data.path=null"]


def test_planned_bytes_equal_the_live_device_tensors():
    recipes = [str(RECIPES / "tiny-bert-classification.yaml"), str(RECIPES / "tiny-llama-clm.yaml")]
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    proc = subprocess.run(
        [sys.executable, "-c", LIVE_BYTES, *recipes], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert set(result) == {"tiny-bert-classification", "tiny-llama-clm"}
    for name, got in result.items():
        assert got["config"] == {"zero1": False, "activation_checkpointing": "none", "tp": 1}, name
        for category in ("parameters", "gradients", "optimizer"):
            assert got["live"][category] > 0
            assert got["planned"][category] == got["live"][category], (name, category)


def test_dry_run_plans_llama_1b_on_trn1_and_refuses_a_tiny_core(tmp_path, capsys):
    """One test for both dry runs: the package logger keeps the stream it last wrote to, and a second test's
    capsys would find the first one's stream closed."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_2_1B))
    code, out, err = cli_in_process(
        capsys, "run", str(RECIPES / "llama-clm.yaml"), "--dry-run", "--nproc-per-node", "32",
        "--set", f"model.pretrained={tmp_path}", *OFFLINE,
    )  # fmt: skip
    assert code == 0, err[-3000:]
    plan = json.loads(out)
    memory = plan["memory"]
    assert plan["model"]["parameters"] == 1_235_814_400
    assert memory["target"] == "trn1" and memory["core_gib"] == 16.0
    dp = memory["candidates"][0]
    assert dp["config"] == {"zero1": False, "activation_checkpointing": "none", "tp": 1} and not dp["fits"]
    assert memory["fits"] and memory["candidates"][-1]["fits"]
    assert memory["choice"] == memory["candidates"][-1]["config"] and memory["choice"]["zero1"] is True
    assert "memory per core: trn1, 16.00 GiB" in err
    assert "DP does not fit" in err
    assert "memory planned for trn1 (runtime.neuron_target auto: xla-cpu), and not enforced" in err

    code, out, err = cli_in_process(
        capsys, "run", str(RECIPES / "tiny-llama-clm.yaml"), "--dry-run", "--set", "runtime.device_memory_gib=0.001",
    )  # fmt: skip
    assert code == 2, err[-2000:]
    assert "memory per core: custom, 0.00 GiB" in err
    errors = [line for line in err.splitlines() if line.startswith("neurontrain: error:")]
    assert len(errors) == 1 and "no configuration fits a 0.00 GiB custom core at 1 worker(s)" in errors[0]
    assert out == ""
