"""torch-xla's own record of the graphs its syncs cut: with XLA_SAVE_TENSORS_FILE (and XLA_SAVE_TENSORS_FMT=hlo)
every sync appends a block to `<file>.<device ordinal>`: the Python frames that caused it, the HLO module, and
torch-xla's graph hash. The file is written during the sync, before the graph runs, so the bytes appended
while a call ran are that call's graphs.

Pure logic over bytes and paths; no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DUMP_FILE_ENV = "XLA_SAVE_TENSORS_FILE"
DUMP_FORMAT_ENV = "XLA_SAVE_TENSORS_FMT"

_BLOCK = re.compile(rb"\[ScheduleSyncTensorsGraph\]\n(.*?)## BEGIN_GRAPH\n(.*?)\n## END_GRAPH", re.S)
_FRAME = re.compile(r"^\s+(\S+) \((.*):(\d+)\)$")


@dataclass(frozen=True)
class DumpedGraph:
    offset: int  # where the block starts in the dump file (bytes)
    hlo: str  # the HLO module as torch-xla printed it
    xla_hash: str  # torch-xla's graph hash
    frames: tuple[str, ...]  # "function (file:line)", innermost first

    def caller(self) -> str:
        """The innermost frame outside torch, torch_xla and lightning: who asked for the graph."""
        for frame in self.frames:
            match = _FRAME.match("  " + frame)
            if match and not re.search(r"/(torch|torch_xla|lightning)/", match.group(2)):
                return frame
        return self.frames[0] if self.frames else "?"


def dump_file(prefix: Path) -> Path | None:
    """The file torch-xla wrote for XLA_SAVE_TENSORS_FILE=prefix (it appends the device ordinal)."""
    found = sorted(prefix.parent.glob(prefix.name + ".*")) if prefix.parent.is_dir() else []
    return found[0] if found else (prefix if prefix.is_file() else None)


def parse_dump(data: bytes) -> list[DumpedGraph]:
    """Every block of a dump, in the order the syncs wrote them."""
    out = []
    for match in _BLOCK.finditer(data):
        info = match.group(1).decode(errors="replace")
        body = match.group(2).decode(errors="replace")
        hlo, _, tail = body.partition("\n\nGraph Hash:")
        frames = []
        in_frames = False
        for line in info.splitlines():
            if line.startswith("TensorsGraphInfo:"):
                in_frames = True
            elif in_frames and line.startswith("  "):
                frames.append(line.strip())
            elif in_frames:
                in_frames = False
        out.append(DumpedGraph(match.start(), hlo, tail.strip(), tuple(frames)))
    return out


def dump_size(prefix: Path) -> int:
    path = dump_file(prefix)
    return path.stat().st_size if path is not None else 0
