"""What happens to a document longer than data.max_length: `truncate` keeps its first max_length tokens, `fail`
refuses the data, `split` cuts it into max_length pieces (the last one shorter) so no token is dropped.

Pure logic. Split pieces are samples of their own: under packing each is a document of its own (per-document
attention), as Hugging Face's run_clm groups a corpus into independent blocks. Documents with a loss mask (SFT data,
`fit_masked`) are never split. Counted in `OverlongCounts`, which the run's summary reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from neurontrain.errors import UsageError

POLICIES = ("truncate", "fail", "split")


@dataclass
class OverlongCounts:
    documents: int = 0  # documents read
    tokens: int = 0  # their tokens, before any cut
    kept_tokens: int = 0
    dropped_tokens: int = 0  # cut away by truncate
    truncated: int = 0  # documents cut by truncate
    split: int = 0  # documents split into several samples
    samples: int = 0  # samples made
    dropped: int = 0  # documents left out: nothing to train on (their answer cut away by truncate, or none)
    trained_tokens: int = 0  # tokens of the samples made that the loss is on (labels not -100)

    def add(self, other: OverlongCounts) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict:
        return asdict(self)


def fit_documents(
    encoded: Sequence[Sequence[int]], max_length: int, policy: str, split_name: str, first_index: int = 0
) -> tuple[list[Sequence[int]], list[int], OverlongCounts]:
    """The samples made of these documents, the document each sample came from (an index into `encoded`), and the
    counts. `first_index` numbers the documents in error messages (their position in the whole split)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown overlong policy {policy!r}")
    samples: list[Sequence[int]] = []
    source: list[int] = []
    counts = OverlongCounts(documents=len(encoded))
    for i, ids in enumerate(encoded):
        n = len(ids)
        counts.tokens += n
        if n <= max_length:
            samples.append(ids)
            source.append(i)
            counts.kept_tokens += n
            continue
        if policy == "fail":
            raise UsageError(
                f"{split_name} sample {first_index + i} has {n} tokens, more than data.max_length {max_length} "
                "(set data.overlong: truncate or split)"
            )
        if policy == "truncate":
            samples.append(ids[:max_length])
            source.append(i)
            counts.truncated += 1
            counts.kept_tokens += max_length
            counts.dropped_tokens += n - max_length
            continue
        pieces = [ids[start : start + max_length] for start in range(0, n, max_length)]
        samples.extend(pieces)
        source.extend([i] * len(pieces))
        counts.split += 1
        counts.kept_tokens += n
    counts.samples = len(samples)
    counts.trained_tokens = sum(max(len(s) - 1, 0) for s in samples)  # every token predicted from the ones before
    return samples, source, counts


def fit_masked(
    encoded: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]],
    max_length: int,
    policy: str,
    split_name: str,
    first_index: int = 0,
) -> tuple[list[Sequence[int]], list[Sequence[int]], list[int], OverlongCounts]:
    """`fit_documents` for documents with a loss mask (conversations, prompt-completion): never split (a piece
    would lose its prompt or have no answer): `split` and `truncate` keep the first max_length tokens, `fail`
    refuses. A document with no trained token after that (its answer cut away, or none at all) is dropped and
    counted; the first token of a sample is never trained on (nothing before it predicts it)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown overlong policy {policy!r}")
    samples: list[Sequence[int]] = []
    kept_masks: list[Sequence[int]] = []
    source: list[int] = []
    counts = OverlongCounts(documents=len(encoded))
    for i, (ids, mask) in enumerate(zip(encoded, masks, strict=True)):
        n = len(ids)
        counts.tokens += n
        if n > max_length and policy == "fail":
            raise UsageError(
                f"{split_name} sample {first_index + i} has {n} tokens, more than data.max_length {max_length} "
                "(set data.overlong: truncate)"
            )
        kept = min(n, max_length)
        trained = int(sum(mask[1:kept]))
        if not trained:
            counts.dropped += 1
            counts.dropped_tokens += n
            continue
        if n > kept:
            counts.truncated += 1
            counts.dropped_tokens += n - kept
        samples.append(ids[:kept])
        kept_masks.append(mask[:kept])
        source.append(i)
        counts.kept_tokens += kept
        counts.trained_tokens += trained
    counts.samples = len(samples)
    return samples, kept_masks, source, counts
