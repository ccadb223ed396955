"""Checkpoints written at test time by the real tools GPU users train with (torch DCP with FSDP2 and FSDP1,
DDP, torch.compile, Lightning, the transformers Trainer, accelerate), on CPU, each after one AdamW step of a tiny
model. Every writer returns (checkpoint path, reference directory): the reference is the same trained weights
written by the model's own save_pretrained."""

import contextlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


@contextlib.contextmanager
def world_of_one():
    """A gloo process group of one rank in this process (no subprocess, no port)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def batch(model):
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    labels = torch.tensor([0, 1]) if model.config.model_type == "bert" else ids
    return {"input_ids": ids, "labels": labels}


def train_step(model, optimizer):
    model(**batch(getattr(model, "module", model))).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _reference(model, full_state, path):
    """A fresh model of the same config loaded with full_state, written by save_pretrained."""
    cls = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))  # FSDP2 subclasses
    fresh = cls(model.config)
    fresh.load_state_dict(full_state)
    fresh.save_pretrained(path)
    return path


def fsdp2_dcp(tmp_path, model):
    """FSDP2 (fully_shard) + get_state_dict + dcp.save({"model": ..., "optimizer": ...}), as torch's docs and
    torchtitan do. Returns (dcp dir, reference dir, the optimizer state dict with full tensors by name)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with world_of_one():
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        train_step(model, optimizer)
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "fsdp2-dcp"))
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        moments = {
            name: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in s.items()}
            for name, s in osd["state"].items()
        }
    return tmp_path / "fsdp2-dcp", _reference(model, full, tmp_path / "fsdp2-ref"), moments


def fsdp1_sharded_dcp(tmp_path, model):
    """FSDP1 SHARDED_STATE_DICT saved through DCP as {"model", "optim"}. Returns (dcp dir, reference dir, the
    moments by parameter name from FSDP's own FULL_STATE_DICT optimizer state)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with world_of_one():
        fsdp = FSDP(model, device_id=torch.device("cpu"))
        optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
        train_step(fsdp, optimizer)
        with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
            state = {"model": fsdp.state_dict(), "optim": FSDP.optim_state_dict(fsdp, optimizer)}
            dcp.save(state, checkpoint_id=str(tmp_path / "fsdp1-dcp"))
        with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT):
            full, moments = fsdp.state_dict(), FSDP.optim_state_dict(fsdp, optimizer)["state"]
    return tmp_path / "fsdp1-dcp", _reference(model, full, tmp_path / "fsdp1-ref"), moments


def ddp_torch_save(tmp_path, model, key="model"):
    """DDP's state dict (`module.` names) and the id-keyed optimizer state in one torch.save dict."""
    from torch.nn.parallel import DistributedDataParallel

    with world_of_one():
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        train_step(ddp, optimizer)
        torch.save({key: ddp.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}, tmp_path / "ddp.pt")
    model.save_pretrained(tmp_path / "ddp-ref")
    return tmp_path / "ddp.pt", tmp_path / "ddp-ref", optimizer


def compiled_torch_save(tmp_path, model):
    """torch.compile's wrapper names every tensor `_orig_mod.`; saved as a training dict."""
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    train_step(model, optimizer)  # eager: the names are what matters, not the compiled graph
    torch.save({"model_state_dict": compiled.state_dict(), "step": 1}, tmp_path / "compiled.pt")
    model.save_pretrained(tmp_path / "compiled-ref")
    return tmp_path / "compiled.pt", tmp_path / "compiled-ref"


def _lightning_module(model):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        def configure_model(self):  # Lightning's hook for wrapping by hand; a no-op without its FSDP strategy
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            if self.trainer.strategy.strategy_name == "fsdp" and not isinstance(self.model, FSDP):
                self.model = FSDP(self.model, device_id=torch.device("cpu"))

        def training_step(self, data, index):
            return self.model(**data).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Module(model)


def _lightning_fsdp_strategy():
    """Lightning's own FSDP strategy with state_dict_type="sharded". Two CPU-only steps around it: Lightning's
    accelerator connector refuses the exact class FSDPStrategy on a CPU accelerator, not a subclass of it, and
    the module wraps itself in FSDP with device_id=cpu in configure_model (Lightning passes the accelerator's
    device index, None on CPU, which torch's FSDP refuses); Lightning then skips its own wrapping."""
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        pass

    return CPUFSDPStrategy(state_dict_type="sharded")


def lightning_ckpt(tmp_path, model, sharded=False):
    """A Lightning Trainer run of one step whose LightningModule holds the model as `self.model`: a .ckpt file
    from trainer.save_checkpoint (names `model.<hf name>`, optimizer_states id-keyed), or with sharded=True the
    `last.ckpt/` directory Lightning's FSDP strategy writes with state_dict_type="sharded" (DCP files holding
    {"model", "optimizer_0"} and meta.pt). The sharded form needs a process of its own (a process group, no
    torch-xla): run it through in_a_process_without_xla."""
    import lightning as L

    module = _lightning_module(model)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=_lightning_fsdp_strategy() if sharded else "auto",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader([batch(model)], batch_size=None))
    path = tmp_path / ("last.ckpt" if sharded else "lightning.ckpt")
    trainer.save_checkpoint(path)
    if sharded:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(module.model, StateDictType.FULL_STATE_DICT):
            full = module.model.state_dict()
        return path, _reference(model, full, tmp_path / "lightning-ref")
    model.save_pretrained(tmp_path / "lightning-ref")
    return path, tmp_path / "lightning-ref"


def hf_trainer(tmp_path, model):
    """transformers Trainer, one step, save_steps=1: output/checkpoint-1/ (weights, optimizer.pt, trainer_state)."""
    from transformers import Trainer, TrainingArguments

    data = batch(model)
    rows = [{k: v[i] for k, v in data.items()} for i in range(2)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=1,
        save_steps=1,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=rows).train()
    model.save_pretrained(tmp_path / "trainer-ref")
    return tmp_path / "trainer" / "checkpoint-1", tmp_path / "trainer-ref"


def accelerate_state(tmp_path, model):
    """accelerate's Accelerator.save_state after one step: model.safetensors, optimizer.bin, random_states_0.pkl
    (no config.json: migrate needs --config)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    prepared, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    train_step(prepared, optimizer)
    accelerator.save_state(str(tmp_path / "accelerate"))
    model.save_pretrained(tmp_path / "accelerate-ref")
    return tmp_path / "accelerate", tmp_path / "accelerate-ref"


def deepspeed_zero(tmp_path, model, stage, world):
    """DeepSpeed ZeRO stage 1-3 on CPU (gloo, fp32, torch's AdamW as the client optimizer), one step on `world`
    data-parallel ranks (forked processes), then engine.save_checkpoint: ds/latest and ds/global_step1/
    partitions. Returns (ds dir, reference dir, ds-moments.pt: the moments of every parameter as DeepSpeed itself
    assembles them from its partitions, safe_get_full_optimizer_state, and the engine's global step)."""
    # fork: the ranks start from this process's model, so every rank holds the same initial weights
    torch.multiprocessing.start_processes(
        _zero_rank, args=(tmp_path, model, stage, world), nprocs=world, start_method="fork"
    )
    return tmp_path / "ds", tmp_path / "ds-ref", tmp_path / "ds-moments.pt"


def deepspeed_zero_cases(tmp_path, cases):
    """deepspeed_zero for each (family, stage, world) of `cases`, each under tmp_path/{family}/zero{stage}-{world},
    every one of a family from the same initial model: one process for all of them (DeepSpeed imported, its op
    probes run and each family's model built once, before the ranks fork) instead of one a case or a family.
    DeepSpeed's CPU shared-memory all-reduce kernel is not built: it serves inference all-reduce only, a GPU
    user's ZeRO run has none, and building it (a C++ compile per Python environment) cost more than every case.
    Returns the three paths of each case in turn."""
    import checkpoint_models
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    get_accelerator()  # once here, not in every forked rank
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # probes every op once, for every rank
    paths, models = [], {}
    for family, stage, world in cases:
        if family not in models:
            (tmp_path / family).mkdir()
            models[family] = getattr(checkpoint_models, family)(tmp_path / family)[0]
        folder = tmp_path / family / f"zero{stage}-{world}"
        folder.mkdir()
        paths += deepspeed_zero(folder, models[family], stage, world)
    return paths


def _zero_rank(rank, tmp_path, model, stage, world):
    import os

    import deepspeed
    from deepspeed.utils import safe_get_full_optimizer_state

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'ds-store'}", rank=rank, world_size=world)
    config = {
        "train_batch_size": 2 * world,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.backward(engine(**batch(model)).loss)
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ds"))
    moments = {  # collectives: every rank asks for every parameter
        name: {key: safe_get_full_optimizer_state(p, key).clone() for key in ("exp_avg", "exp_avg_sq")}
        for name, p in model.named_parameters()
    }
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"moments": moments, "global_steps": engine.global_steps}, tmp_path / "ds-moments.pt")
        _reference(model, full, tmp_path / "ds-ref")
    dist.destroy_process_group()


def in_a_process_without_xla(writer, tmp_path, family, env=None, **options):
    """Run `writer(tmp_path, model)` in a fresh process with USE_TORCH_XLA=0: transformers' Trainer and accelerate
    would otherwise train on the XLA device torch-xla provides here (a GPU user's run has none). The model is
    the family's tiny model (checkpoint_models), built there with the same seed; with family None the writer
    gets none (`writer(tmp_path)`). Returns the writer's paths."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent)
    code = (
        f"import sys, json; sys.path.insert(0, {tests!r})\n"
        "from pathlib import Path\n"
        "import checkpoint_models, checkpoint_tools\n"
        + (f"model, _ = checkpoint_models.{family}(Path({str(tmp_path)!r}))\n" if family else "")
        + f"paths = checkpoint_tools.{writer.__name__}(Path({str(tmp_path)!r}), {'model, ' if family else ''}"
        f"**{options!r})\n"
        "print(json.dumps([str(p) for p in paths]))\n"
    )
    env = {**os.environ, "USE_TORCH_XLA": "0", "PJRT_DEVICE": "CPU", **(env or {})}
    with socket.socket() as s:  # always a free one: an inherited or default port was seen taken by other tests
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    return [Path(p) for p in json.loads(res.stdout.strip().splitlines()[-1])]
