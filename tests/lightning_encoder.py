"""A plain LightningModule built from torch's own layers, trained with `neurontrain.lightning.trainer_args`: an
`nn.Embedding`, an `nn.TransformerEncoderLayer(batch_first=True, dropout=0)` with a key padding mask, a linear
head, a collator that pads each batch to its longest sample, `self.log(prog_bar=True)`, validation every 20
training batches, accumulation 2, clipping and AdamW. Used by tests/integration/test_lightning.py.

    python tests/lightning_encoder.py --output-dir DIR --max-steps 40
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import neurontrain.lightning

VOCAB, HIDDEN = 64, 32


class Encoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import os
        V = os.environ.get("V", "")
        self.V = V
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN, padding_idx=0 if "p" in V else None)
        ff = 2048 if "f" in V else 64
        self.layer = torch.nn.TransformerEncoderLayer(
            HIDDEN, nhead=4, dim_feedforward=ff, dropout=0.0, batch_first=True, **({"norm_first": True, "activation": "gelu"} if "w" in V else {})
        )
        if "w" in V:
            self.layer = torch.nn.TransformerEncoder(self.layer, num_layers=2)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        if "t" in V:
            self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = ~attention_mask.bool() if "b" in self.V else attention_mask == 0
        if "n" in self.V:
            m = None
        x = self.layer(self.embed(input_ids), src_key_padding_mask=m)
        return self.head(x)

    def _loss(self, batch: dict) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, **({"on_epoch": True} if "e" in self.V else {}))
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, **({"sync_dist": True} if "y" in self.V else {}))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if "g" in self.V:
            decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
            no = [p for n, p in self.named_parameters() if p.dim() < 2]
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no, "weight_decay": 0.0}], lr=1e-3)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        if "L" in self.V:
            sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}
        return opt


class Sequences(Dataset):
    """Token sequences x[t+1] = x[t] + d (mod VOCAB) of random lengths in [5, max_len]."""

    def __init__(self, n: int, seed: int, max_len: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(5, max_len + 1, (1,), generator=gen))
            start, d = (int(v) for v in torch.randint(0, VOCAB, (2,), generator=gen))
            self.items.append((torch.arange(length) * (d % 7 + 1) + start) % VOCAB)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]


def pad_collate(samples: list[torch.Tensor]) -> dict:
    """GPU-style dynamic padding: each batch padded to its own longest sample."""
    length = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    labels = torch.full((len(samples), length), -100, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
        labels[i, : len(s) - 1] = s[1:]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--max-len", type=int, default=60)
    args = p.parse_args()
    pl.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(0)
    train = DataLoader(Sequences(64 if "s" in os.environ.get("V", "") else 2 * 8 * args.max_steps, 1, args.max_len), batch_size=8, shuffle=True,
                       collate_fn=pad_collate, generator=gen, drop_last=True)  # fmt: skip
    val = DataLoader(Sequences(16, 2, args.max_len), batch_size=8, collate_fn=pad_collate)
    if "r" in os.environ.get("V", ""):
        val = DataLoader(Sequences(24, 2, args.max_len), batch_size=16, collate_fn=pad_collate)
    if "T" in os.environ.get("V", ""):
        train = DataLoader(Sequences(16, 1, args.max_len), batch_size=8, shuffle=True, collate_fn=pad_collate, generator=gen)
    if "R" in os.environ.get("V", ""):
        train = DataLoader(Sequences(20, 1, args.max_len), batch_size=8, shuffle=True, collate_fn=pad_collate, generator=gen)
    trainer = pl.Trainer(
        **neurontrain.lightning.trainer_args(buckets="auto", recompile_guard="warn", output_dir=args.output_dir),
        max_steps=args.max_steps,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        val_check_interval=20,
        check_val_every_n_epoch=None,
        **({} if "d" in os.environ.get("V", "") else dict(logger=False, enable_checkpointing=False, enable_model_summary=False)),
        default_root_dir=str(Path(args.output_dir)),
    )
    trainer.fit(Encoder(), train, val)


if __name__ == "__main__":
    neurontrain.lightning.main(main)
