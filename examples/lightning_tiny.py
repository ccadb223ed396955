"""A tiny Lightning script, unchanged except for its Trainer arguments, trained with neurontrain on a PJRT device.

    python examples/lightning_tiny.py --max-steps 40            # neurontrain.lightning (XLA:CPU here)
    python examples/lightning_tiny.py --max-steps 40 --plain    # plain Lightning + a bare accelerator shim
    python examples/lightning_tiny.py --max-steps 40 --eager    # plain Lightning on the CPU, no XLA
    neurontrain precompile --lightning "examples/lightning_tiny.py:build --max-steps 40"   # its graphs, ahead

The module uses automatic optimization, `self.log(prog_bar=True)`, `validation_step`, a dynamic-padding
DataLoader, `ModelCheckpoint`, accumulation 2, gradient clipping and a per-step LR schedule. Every mode writes
`losses.json` (the loss of every training batch, in order); --plain and --eager write `plain_summary.json`
(graphs compiled and device->host reads, counted the same way as neurontrain's summary.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

VOCAB, HIDDEN = 64, 32


class TinyEncoder(pl.LightningModule):
    """One masked self-attention block and a token head: next-token prediction on synthetic sequences."""

    def __init__(self, max_steps: int, item: bool = False) -> None:
        super().__init__()
        self.max_steps, self.item = max_steps, item
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.pos = torch.nn.Embedding(128, HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.norm1, self.norm2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 64), torch.nn.GELU(), torch.nn.Linear(64, HIDDEN))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(HIDDEN)
        length = input_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None] & attention_mask[:, None, :].bool()
        scores = scores.masked_fill(~allowed, -1e9)
        x = x + torch.softmax(scores, dim=-1) @ v
        x = x + self.mlp(self.norm2(x))
        return self.head(x)

    def _loss(self, batch: dict) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        if self.item:
            print(f"loss {loss.item():.4f}")  # a host sync inside the step: the guard names it
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        warmup = 5

        def factor(step: int) -> float:  # never 0 or 1 x lr: XLA bakes the scalars 0 and 1 into graphs
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / self.max_steps)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Sequences(Dataset):
    """Arithmetic token sequences x[t+1] = x[t] + d (mod VOCAB) of random lengths in [min_len, max_len]."""

    def __init__(self, n: int, seed: int, min_len: int = 5, max_len: int = 60) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
            start, d = (int(v) for v in torch.randint(0, VOCAB, (2,), generator=gen))
            self.items.append((torch.arange(length) * (d % 7 + 1) + start) % VOCAB)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]


def pad_collate(samples: list[torch.Tensor]) -> dict:
    """Dynamic padding: each batch padded to its own longest sequence."""
    length = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    labels = torch.full((len(samples), length), -100, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
        labels[i, : len(s) - 1] = s[1:]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loaders(max_len: int, batch_size: int = 8) -> tuple[DataLoader, DataLoader]:
    gen = torch.Generator().manual_seed(0)
    train = DataLoader(Sequences(160, 1, max_len=max_len), batch_size=batch_size, shuffle=True,
                       collate_fn=pad_collate, generator=gen, drop_last=True)  # fmt: skip
    val = DataLoader(Sequences(48, 2, max_len=max_len), batch_size=batch_size, collate_fn=pad_collate)
    return train, val


class LossRecorder(pl.Callback):
    """Every training batch's loss, read once when the fit ends (after neurontrain's summary)."""

    def __init__(self, path: Path) -> None:
        self.path, self.losses = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].detach())

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:  # one writer: every rank writing the same file interleaved their texts
            self.path.write_text(json.dumps([float(v.cpu()) for v in self.losses]))


class XlaCounters(pl.Callback):
    """--plain: graphs compiled and device->host reads from the fit's start to the end of training."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @staticmethod
    def _read() -> tuple[int, int]:
        import torch_xla.debug.metrics as met  # lazy: only --plain

        compiles, reads = met.metric_data("CompileTime"), met.metric_data("TransferFromDeviceTime")
        return (int(compiles[0]) if compiles else 0), (int(reads[0]) if reads else 0)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.start = self._read()

    def on_train_end(self, trainer, pl_module) -> None:
        graphs, reads = (b - a for a, b in zip(self.start, self._read()))
        steps = trainer.global_step
        out = {"graphs": graphs, "host_reads": reads, "host_reads_per_step": round(reads / steps, 3), "steps": steps}
        self.path.write_text(json.dumps(out))
        import torch_xla  # lazy: only --plain

        # after counting: Lightning's teardown copies every parameter and optimizer state to the CPU one by one,
        # and without a sync each copy would compile the whole pending update as a graph of its own
        torch_xla.sync()


def bare_shim() -> dict:
    """What a user writes to start plain Lightning on a non-TPU PJRT device: an accelerator that says it is there,
    and Lightning's single-device strategy on the XLA device."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla  # lazy: only the --plain comparison uses torch-xla directly
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class Shim(Accelerator):
        setup_device = teardown = lambda self, *a: None  # noqa: E731
        parse_devices = staticmethod(lambda d: 1)
        get_parallel_devices = staticmethod(lambda d: [torch_xla.device()])
        auto_device_count = staticmethod(lambda: 1)
        is_available = staticmethod(lambda: True)
        name = staticmethod(lambda: "shim")

    shim = Shim()
    return {"strategy": SingleDeviceStrategy(device=torch_xla.device(), accelerator=shim)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--output-dir", default="runs/lightning_tiny")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--plain", action="store_true", help="plain Lightning with a bare accelerator shim")
    mode.add_argument("--eager", action="store_true", help="plain Lightning on the CPU (no XLA)")
    p.add_argument("--buckets", default="auto", help="auto, or lengths: 16,32,64")
    p.add_argument("--recompile-guard", default="warn", choices=("warn", "fail", "off"))
    p.add_argument("--no-preflight", action="store_true")
    p.add_argument("--expected-devices", type=int, default=None, help="devices preflight expects")
    p.add_argument("--item", action="store_true", help="read the loss with .item() inside training_step")
    p.add_argument("--max-len", type=int, default=60, help="longest training/validation sequence")
    p.add_argument("--batch-size", type=int, default=8, help="rows per batch (per worker under torchrun)")
    p.add_argument("--accumulate", type=int, default=2, help="accumulate_grad_batches")
    p.add_argument("--resume", action="store_true", help="keep last.ckpt and resume from it when it exists")
    return p.parse_args(argv)


class SequenceData(pl.LightningDataModule):
    def __init__(self, max_len: int, batch_size: int) -> None:
        super().__init__()
        self.max_len, self.batch_size = max_len, batch_size

    def train_dataloader(self) -> DataLoader:
        return loaders(self.max_len, self.batch_size)[0]

    def val_dataloader(self) -> DataLoader:
        return loaders(self.max_len, self.batch_size)[1]


def build(argv: list[str] | None = None) -> tuple[pl.LightningModule, pl.LightningDataModule, dict]:
    """The module, its data and the Trainer arguments: what `main` fits, and what
    `neurontrain precompile --lightning "examples/lightning_tiny.py:build ARGS"` precompiles."""
    args = parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    extra: list[pl.Callback] = [LossRecorder(out / "losses.json")]
    if args.eager:
        trainer_kwargs: dict = {"accelerator": "cpu"}
    elif args.plain:
        trainer_kwargs = bare_shim()
        extra.append(XlaCounters(out / "plain_summary.json"))
    else:
        import neurontrain.lightning

        buckets = args.buckets if args.buckets == "auto" else [int(b) for b in args.buckets.split(",")]
        trainer_kwargs = neurontrain.lightning.trainer_args(
            buckets=buckets, recompile_guard=args.recompile_guard, preflight=not args.no_preflight,
            output_dir=out, expected_devices=args.expected_devices,
        )  # fmt: skip
    trainer_kwargs.update(
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0,
        callbacks=[
            ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_loss", save_top_k=1, save_last=args.resume),
            *extra,
        ],
        logger=False,
        default_root_dir=str(out),
        enable_model_summary=False,
    )
    return TinyEncoder(args.max_steps, item=args.item), SequenceData(args.max_len, args.batch_size), trainer_kwargs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model, data, trainer_kwargs = build(argv)
    trainer = pl.Trainer(**trainer_kwargs)
    out = Path(args.output_dir)
    resume = "last" if args.resume and (out / "checkpoints" / "last.ckpt").exists() else None
    trainer.fit(model, datamodule=data, ckpt_path=resume)


if __name__ == "__main__":
    if "--eager" in sys.argv[1:] or "--plain" in sys.argv[1:]:
        main()
    else:
        import neurontrain.lightning

        neurontrain.lightning.main(main)
