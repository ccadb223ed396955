"""A plain LightningModule from torch's own layers, trained with `neurontrain.lightning.trainer_args` (used by
tests/integration/test_lightning.py): an `nn.Embedding`, an `nn.TransformerEncoderLayer(batch_first=True,
dropout=0)` under a key padding mask, a linear head; a collator that pads each batch to its longest sample,
`self.log(prog_bar=True)`, validation every 20 training batches, accumulation 2, clipping and AdamW.

Two loaders as a GPU script often has them: validation batches twice the training ones (24 samples: the sanity
check's two batches have 16 and 8 rows), and 5 training batches an epoch (drop_last off), so every epoch ends with
an optimizer step after one micro-batch.

    python tests/lightning_encoder.py --output-dir DIR --max-steps 24
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import neurontrain.lightning

VOCAB, HIDDEN = 64, 32


class Encoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layer = torch.nn.TransformerEncoderLayer(
            HIDDEN, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(input_ids), src_key_padding_mask=attention_mask == 0))

    def _loss(self, batch: dict) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Sequences(Dataset):
    """Token sequences x[t+1] = x[t] + d (mod VOCAB) of random lengths in [5, max_len]."""

    def __init__(self, n: int, seed: int, max_len: int = 60) -> None:
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


def loaders() -> tuple[DataLoader, DataLoader]:
    gen = torch.Generator().manual_seed(0)
    train = DataLoader(Sequences(40, 1), batch_size=8, shuffle=True, collate_fn=pad_collate, generator=gen)
    return train, DataLoader(Sequences(24, 2), batch_size=16, collate_fn=pad_collate)


TRAINER_ARGS = {  # besides neurontrain's and max_steps
    "accumulate_grad_batches": 2,
    "gradient_clip_val": 1.0,
    "val_check_interval": 20,
    "check_val_every_n_epoch": None,
    "logger": False,
    "enable_checkpointing": False,
    "enable_model_summary": False,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=24)
    args = p.parse_args()
    pl.seed_everything(0, verbose=False)
    train, val = loaders()
    trainer = pl.Trainer(
        **neurontrain.lightning.trainer_args(buckets="auto", recompile_guard="warn", output_dir=args.output_dir),
        **TRAINER_ARGS,
        max_steps=args.max_steps,
        default_root_dir=args.output_dir,
    )
    trainer.fit(Encoder(), train, val)


if __name__ == "__main__":
    neurontrain.lightning.main(main)
