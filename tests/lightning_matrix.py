"""Lightning modules written the way Lightning's docs write them, each fitted in this one process through
`neurontrain.lightning.trainer_args(buckets="auto", recompile_guard="fail")` (used by
tests/integration/test_lightning.py): the module of the Lightning logging issue, and the same with
`num_sanity_val_steps=0`, on_epoch logging, `sync_dist=True`, torchmetrics Accuracy, a step-interval LR schedule,
a Hugging Face model, a LightningDataModule, `limit_val_batches`, and torch's encoder layer with bigger eval
batches and odd epochs (tests/lightning_encoder.py).

Each fit runs 2N optimizer steps and reports the compile count (torch-xla's `CompileTime` count, a counter delta:
several fits share the process) when step N + 1 starts and when training ends, with its summary.json. Each
variant has a hidden size of its own, so no fit finds its model's graphs compiled by an earlier one.

    python tests/lightning_matrix.py --output-dir DIR [--steps N] [VARIANT ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import neurontrain.lightning

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lightning_encoder  # noqa: E402  (tests/ is not a package)


def samples(n: int, seed: int) -> list:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = max(4, min(60, int(rng.lognormvariate(3.0, 0.6))))
        out.append((torch.randint(1, 300, (length,), generator=gen), int(rng.random() < 0.5)))
    return out


def collate(items: list) -> dict:
    """A GPU-style collator: pad to the longest in the batch."""
    n = max(len(x) for x, _ in items)
    ids = torch.zeros(len(items), n, dtype=torch.long)
    mask = torch.zeros(len(items), n, dtype=torch.long)
    for i, (x, _) in enumerate(items):
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([y for _, y in items])}


def loaders(train_samples: int = 2000) -> tuple[DataLoader, DataLoader]:
    train = DataLoader(samples(train_samples, 3), batch_size=8, collate_fn=collate, shuffle=True)
    return train, DataLoader(samples(32, 4), batch_size=8, collate_fn=collate)


class Classifier(pl.LightningModule):
    """The issue's module: an embedding, one TransformerEncoderLayer, a linear head, AdamW; `log` holds the
    `self.log` arguments a variant adds, `scheduler` a per-step LR schedule."""

    def __init__(self, hidden: int = 32, log: dict | None = None, scheduler: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(300, hidden)
        self.enc = torch.nn.TransformerEncoderLayer(hidden, 2, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(hidden, 2)
        self.log_args, self.scheduler = log or {}, scheduler

    def forward(self, b: dict) -> torch.Tensor:
        h = self.enc(self.emb(b["input_ids"]), src_key_padding_mask=b["attention_mask"] == 0)
        m = b["attention_mask"].unsqueeze(-1).float()
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1))

    def training_step(self, b: dict, i: int) -> torch.Tensor:
        loss = F.cross_entropy(self(b), b["labels"])
        self.log("loss", loss, prog_bar=True, **self.log_args)
        return loss

    def validation_step(self, b: dict, i: int) -> None:
        self.log("val_loss", F.cross_entropy(self(b), b["labels"]), **self.log_args)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        if not self.scheduler:
            return optimizer
        total = self.trainer.max_steps
        linear = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / total)  # 1 at 0, 0 at the end
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": linear, "interval": "step"}}


class WithAccuracy(Classifier):
    """torchmetrics' Accuracy objects logged as Lightning's docs show (the metric object, epoch-level)."""

    def __init__(self, hidden: int) -> None:
        super().__init__(hidden)
        import torchmetrics

        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)

    def training_step(self, b: dict, i: int) -> torch.Tensor:
        logits = self(b)
        self.train_acc(logits, b["labels"])
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        loss = F.cross_entropy(logits, b["labels"])
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, b: dict, i: int) -> None:
        logits = self(b)
        self.val_acc.update(logits, b["labels"])
        self.log("val_acc", self.val_acc, on_epoch=True, prog_bar=True)
        self.log("val_loss", F.cross_entropy(logits, b["labels"]))


class HFClassifier(pl.LightningModule):
    """A Hugging Face model (tiny BERT from its config class) inside the module: a scheduler stepped every step,
    `sync_dist=True` logging on step and epoch."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=300, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        self.model = BertForSequenceClassification(config)

    def training_step(self, b: dict, i: int) -> torch.Tensor:
        loss = self.model(**b).loss
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, b: dict, i: int) -> None:
        self.log("val_loss", self.model(**b).loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=5e-4)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class ClassificationData(pl.LightningDataModule):
    def __init__(self, train_samples: int) -> None:
        super().__init__()
        self.train_samples = train_samples

    def setup(self, stage: str) -> None:
        self.train, self.val = samples(self.train_samples, 3), samples(32, 4)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=8, collate_fn=collate, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=8, collate_fn=collate)


class CountingLogger(CSVLogger):
    """Lightning's CSV logger, counting its logging points (calls of `log_metrics`) and the values they log."""

    def __init__(self, out: Path) -> None:
        super().__init__(out)
        self.points = self.values = 0

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.points += 1
        self.values += len(metrics)
        super().log_metrics(metrics, step)


def variant(name: str, out: Path) -> tuple[pl.LightningModule, dict, dict]:
    """(module, fit arguments, Trainer arguments) of one variant. Short epochs: 80 samples, 5 optimizer steps,
    validation at each epoch's end."""
    issue = {"accumulate_grad_batches": 2, "val_check_interval": 20, "gradient_clip_val": 1.0}
    issue.update(logger=False, enable_checkpointing=False)
    epochs = {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0, "enable_checkpointing": False}
    epochs.update(logger=CountingLogger(out), log_every_n_steps=5, check_val_every_n_epoch=1)
    train, val = loaders()
    short_train, _ = loaders(80)
    table = {
        "issue": (Classifier(32), {}, issue),
        "no_sanity": (Classifier(40), {}, {**issue, "num_sanity_val_steps": 0}),
        "on_epoch": (Classifier(48, {"on_step": True, "on_epoch": True}), {}, epochs),
        "sync_dist": (Classifier(56, {"sync_dist": True}), {}, issue),
        "torchmetrics": (WithAccuracy(64), {}, epochs),
        "scheduler": (Classifier(72, scheduler=True), {}, issue),
        "huggingface": (HFClassifier(24), {}, epochs),
        "datamodule": (Classifier(80), {"datamodule": ClassificationData(80)}, epochs),
        "limit_val": (Classifier(88), {}, {**issue, "limit_val_batches": 2}),
        "encoder": (lightning_encoder.Encoder(), {}, {}),
    }
    module, fit, trainer = table[name]
    if name == "encoder":
        train, val = lightning_encoder.loaders()
        trainer = lightning_encoder.TRAINER_ARGS
    elif "datamodule" not in fit:
        train = short_train if trainer is epochs else train
    return module, fit or {"train_dataloaders": train, "val_dataloaders": val}, trainer


SHORT = ("on_epoch", "torchmetrics", "huggingface", "datamodule")  # N = 5 steps: an epoch
VARIANTS = ("issue", "no_sanity", "on_epoch", "sync_dist", "torchmetrics", "scheduler", "huggingface")
VARIANTS += ("datamodule", "limit_val", "encoder")


class FitCounts(pl.Callback):
    """torch-xla's compile count when step `at` + 1 starts (after step `at`'s validation) and at the end; the
    validation runs (the sanity check's too) and epochs the fit went through."""

    def __init__(self, at: int) -> None:
        self.at, self.counts = at, {"validation_runs": 0, "epochs": 0}

    def on_validation_end(self, trainer, pl_module) -> None:
        self.counts["validation_runs"] += 1

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.counts["epochs"] += 1

    @staticmethod
    def _compiles() -> int:
        import torch_xla.debug.metrics as met  # lazy: importing torch_xla starts a runtime

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def on_fit_start(self, trainer, pl_module) -> None:
        self.counts["start"] = self._compiles()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at and "at_n" not in self.counts:
            self.counts["at_n"] = self._compiles() - self.counts["start"]

    def on_train_end(self, trainer, pl_module) -> None:
        self.counts["at_2n"] = self._compiles() - self.counts["start"]


def fit(name: str, out: Path, steps: int) -> dict:
    """One variant's fit of 2 x `steps` optimizer steps: its compile counts, summary.json, or its error."""
    started = time.process_time()
    pl.seed_everything(0, verbose=False)
    module, data, trainer_args = variant(name, out)
    counts = FitCounts(steps)
    trainer = pl.Trainer(
        **neurontrain.lightning.trainer_args(buckets="auto", recompile_guard="fail", preflight=False, output_dir=out),
        **{"enable_model_summary": False, "default_root_dir": str(out), **trainer_args},
        max_steps=2 * steps,
        callbacks=[counts],
    )
    error = None
    try:
        trainer.fit(module, **data)
    except Exception as exc:  # an unexpected graph under "fail", reported with the fit's name
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    logger = trainer.logger if isinstance(trainer.logger, CountingLogger) else None
    summary = out / "summary.json"
    return {
        "error": error,
        **counts.counts,
        "steps": 2 * steps,
        "log_points": logger.points if logger else 0,
        "logged_values": logger.values if logger else 0,
        "cpu_seconds": round(time.process_time() - started, 1),
        "summary": json.loads(summary.read_text()) if summary.is_file() else None,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=10, help="N: each fit runs 2N steps (N / 2 for the short epochs)")
    p.add_argument("variants", nargs="*", default=list(VARIANTS))
    args = p.parse_args()
    out = Path(args.output_dir)
    steps = {name: args.steps // 2 if name in SHORT else args.steps for name in args.variants}
    results = {name: fit(name, out / name, steps[name]) for name in args.variants}
    if os.environ.get("RANK", "0") == "0":  # under torchrun (2 workers): rank 0's figures
        (out / "matrix.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
