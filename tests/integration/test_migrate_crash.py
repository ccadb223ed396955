"""A migrate killed with SIGKILL half way, then the same command again: it finishes and leaves no partial
directory (issue 14, crash hygiene). The pure cases are in tests/unit/test_checkpoint_staging.py."""

import json
import os
import signal
import socket
import time

import torch
from conftest import run_cli, start_cli
from safetensors.torch import save_file

HIDDEN, FFN, LAYERS, VOCAB, HEADS, KV_HEADS = 1024, 4096, 2, 16000, 16, 8


def big_llama(path):
    """A generated HF Llama checkpoint of 132 MB (bf16): a migrate to TP 8 spends a few seconds writing its
    rank files, after a start of about ten (imports). Names and config as transformers' LlamaForCausalLM
    has them, written out here: importing transformers in this process would cost more than the rest of
    the set-up (the migrate builds the model on the meta device and refuses names that do not match)."""
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        for proj, shape in [("q", (HIDDEN, HIDDEN)), ("k", (kv, HIDDEN)), ("v", (kv, HIDDEN)), ("o", (HIDDEN, HIDDEN))]:
            shapes[f"{layer}.self_attn.{proj}_proj.weight"] = shape
        for proj, shape in [("gate", (FFN, HIDDEN)), ("up", (FFN, HIDDEN)), ("down", (HIDDEN, FFN))]:
            shapes[f"{layer}.mlp.{proj}_proj.weight"] = shape
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"{layer}.{norm}.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    tensors = {n: torch.full(shape, i / 8, dtype=torch.bfloat16) for i, (n, shape) in enumerate(shapes.items())}
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_sigkill_during_migrate_then_the_same_command_finishes_and_cleans_up(tmp_path):
    src, dest = big_llama(tmp_path / "hf"), tmp_path / "nxd"
    args = ["checkpoint", "migrate", str(src), str(dest), "--to", "neuron", "--tp", "8"]
    proc = start_cli(*args)
    try:
        deadline = time.time() + 120
        while not list(tmp_path.glob(".nxd.partial-*/model/*.pt")):
            assert proc.poll() is None and time.time() < deadline, "the migrate ended before its first rank file"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    (partial,) = tmp_path.glob(".nxd.partial-*")
    assert len(list((partial / "model").iterdir())) < 8 and not dest.exists()
    assert len(list(tmp_path.glob(".nxd.lock-*"))) == 1  # its lock file, no longer held

    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["files"] == 8
    assert (dest / "done").is_file() and len(list((dest / "model").iterdir())) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "nxd"]  # no partial, lock or old left
    assert (
        "removed a partial destination left by a migrate that did not finish "
        f"(pid {proc.pid} on {socket.gethostname()}): {partial}"
    ) in again.stderr
