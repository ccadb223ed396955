"""A sitecustomize that makes torch_xla unimportable in the processes a test starts, as on a TorchNeuron host
where torch-xla is not installed; its log shows it was loaded and whether anything looked for torch_xla."""

from pathlib import Path

# Loaded first by every Python process started with this directory on PYTHONPATH: each import finder answers
# "not found" for torch_xla (and its extension _XLAC), as on a TorchNeuron host where torch-xla is not installed.
BLOCKER = """
import os, sys

BLOCKED = ("torch_xla", "_XLAC")
LOG = os.environ["NO_TORCH_XLA_LOG"]


class _WithoutTorchXla:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            with open(LOG, "a") as fh:
                fh.write(f"refused {name}\\n")
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


sys.meta_path[:] = [_WithoutTorchXla(finder) for finder in sys.meta_path]
with open(LOG, "a") as fh:
    fh.write(f"active in {os.getpid()}\\n")
"""


def without_torch_xla(root: Path, also: str = "") -> dict:
    """Environment for a process in which torch_xla cannot be imported; `also`: more sitecustomize code."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "sitecustomize.py").write_text(BLOCKER + also)
    return {"PYTHONPATH": str(root), "NO_TORCH_XLA_LOG": str(root / "blocked.log")}
