"""neurontrain for PyTorch Lightning users: `Trainer(**neurontrain.lightning.trainer_args(...), ...)` trains an
unchanged LightningModule on a PJRT device (Trainium, XLA:CPU) with buckets, the recompilation guard and
preflight. Needs the `lightning` package (`pip install "neurontrain[lightning]"`); nothing else in neurontrain
imports this package.
"""

try:
    import lightning.pytorch  # noqa: F401
except ImportError as exc:  # one line instead of a missing-module error from deep inside
    raise ImportError(
        'neurontrain.lightning needs the lightning package: pip install "neurontrain[lightning]"'
    ) from exc

from neurontrain.lightning.args import main, trainer_args  # noqa: E402
from neurontrain.lightning.strategy import NeurontrainStrategy, PJRTAccelerator  # noqa: E402

__all__ = ["NeurontrainStrategy", "PJRTAccelerator", "main", "trainer_args"]
