"""Stand-in for neuronx-distributed 2.29 (tests only; see ../README.md). NxD's own __init__ imports much more
(trainer, pipeline, trace, ...); only parallel_layers is here."""

from . import parallel_layers  # noqa: F401
