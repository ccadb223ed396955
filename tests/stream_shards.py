"""JSON-lines shards for the streaming tests: generated stories, every seventh document several stories long
(longer than the rows, so documents continue across rows), a blank line, and one shard without a final newline."""

import json
from pathlib import Path

from neurontrain.data.synthetic import story_text


def shard_texts(shards: int, per_shard: int, seed: int = 0) -> list[list[str]]:
    stories = [r["text"] for r in story_text(shards * per_shard + 8, seed)]
    out = []
    for k in range(shards):
        texts = []
        for i in range(k * per_shard, (k + 1) * per_shard):
            texts.append(" ".join(stories[i : i + 6]) if i % 7 == 0 else stories[i])
        out.append(texts)
    return out


def write_shards(root: Path, shards: int = 3, per_shard: int = 60, seed: int = 0) -> list[Path]:
    """Shards part-000.jsonl ... under root; returns their paths in order."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, texts in enumerate(shard_texts(shards, per_shard, seed)):
        lines = [json.dumps({"text": t, "id": f"{k}-{i}"}) for i, t in enumerate(texts)]
        lines.insert(3, "")  # a blank line is skipped, its bytes counted
        path = root / f"part-{k:03d}.jsonl"
        path.write_text("\n".join(lines) + ("" if k == shards - 1 else "\n"))
        paths.append(path)
    return paths
