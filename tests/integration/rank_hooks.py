"""A sitecustomize hook for the rank-divergence tests: in the worker of RANK 1 only, every training micro-batch is
cut to half its length (another bucket than its peers'), as a rank that took another code path would be. The
first cut writes its time to $NEURONTRAIN_TEST_DIVERGE/diverged_at, for the tests to time the run's end from."""

from pathlib import Path

DIVERGE_RANK1 = """
import os, time
if os.environ.get("RANK") == "1" and os.environ.get("NEURONTRAIN_TEST_DIVERGE"):
    from neurontrain.plan import planning

    _collator = planning.RunPlan.collator

    def _halved(self, split, rank):
        collate = _collator(self, split, rank)
        if split != "train":
            return collate

        def cut(batch):
            stamp = os.path.join(os.environ["NEURONTRAIN_TEST_DIVERGE"], "diverged_at")
            if not os.path.exists(stamp):
                with open(stamp, "w") as fh:
                    fh.write(str(time.time()))
            out = collate(batch)
            return {k: v[:, : v.shape[1] // 2] if getattr(v, "dim", lambda: 0)() == 2 else v for k, v in out.items()}

        return cut

    planning.RunPlan.collator = _halved
"""


def diverging_rank1(root: Path) -> dict:
    """Environment for a run whose rank 1 diverges (a sitecustomize of its own under `root`)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "sitecustomize.py").write_text(DIVERGE_RANK1)
    return {"PYTHONPATH": str(root), "NEURONTRAIN_TEST_DIVERGE": str(root)}
