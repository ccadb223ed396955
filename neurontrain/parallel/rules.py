"""Tensor-parallel and pipeline-parallel sharding rules, as data, and the pure functions that apply them.

A model family is a list of (pattern, rule) pairs over Hugging Face parameter names; the first match wins.
They are resolved from transformers' tensor-parallel plan or a hand table (plans.py) and stored in the spec.
Rules:
  replicate   every TP rank holds the whole tensor;  vocab  split on dim 0 (embeddings, lm_head), zero-padded
  column      split on dim 0 (column-parallel weights and their biases; dim 1 of 3-D expert weights);
  row         split on the last dim (row-parallel weights; their biases are replicated)
  q / k / v   attention projections, split by heads with GQA awareness (see below); may be fused
  o           attention output, split on dim 1 by the query heads each rank holds
  gate / up   MLP projections, column-parallel and concatenated per rank into `gate_up_proj`
  qkv_packed  a fused q|k|v projection (Phi-3's qkv_proj): the rank's q, k and v rows as q / k / v give them,
              three ranges of one tensor; `conv1d_qkv` the same on the columns of a Conv1D (GPT-2's c_attn)
  gate_up_packed  a fused gate|up projection: the rank's rows of each half
  conv1d_column / conv1d_row  Conv1D weights, (in, out): split on dim 1 / dim 0

GQA (Neuron's layout): with TP > KV heads, M = TP / KV copies of each KV head are made (`full.repeat(M, 1)`) so
rank r holds KV head r mod KV, and the query heads are permuted so each rank holds the query heads that use its KV
head under Hugging Face's grouping (and o_proj's columns). With TP <= KV heads, heads are split contiguously and
not permuted. Merging keeps the first copy of each KV head.

Vocabulary padding (as Megatron and NxD's parallel embedding do): when TP does not divide the vocabulary, or a
multiple is asked for, vocab-split tensors get zero rows appended up to the padded size before the split; merging
drops them again, whatever training wrote into them.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import torch

from neurontrain.errors import UsageError
from neurontrain.parallel.plans import config_object, resolve_rules
from neurontrain.parallel.rule_tables import BERT_RULES as BERT_RULES
from neurontrain.parallel.rule_tables import LEGACY_FAMILIES
from neurontrain.parallel.rule_tables import LLAMA_RULES as LLAMA_RULES

FAMILIES = LEGACY_FAMILIES  # the families a spec without stored rules is read with
_LAYER = re.compile(r"\.(?:layers?|h)\.(\d+)\.")


@dataclass(frozen=True)
class ShardingSpec:
    """Everything needed to shard and to merge back; written beside the shards as JSON."""

    family: str
    tp: int
    pp: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    fuse_qkv: bool = False
    tied_embeddings: bool = False
    dtype: str | None = None
    names: list[str] = field(default_factory=list)  # the source's parameter names, in order
    padded_vocab_size: int | None = None  # rows of vocab-split tensors on the Neuron side; None: no padding
    rules: list[list[str]] | None = None  # [pattern, rule] pairs, first match wins; None: the family's legacy table

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ShardingSpec:
        return cls(**data)

    @property
    def table(self) -> list:
        return self.rules if self.rules is not None else FAMILIES[self.family]

    @property
    def vocab_rows(self) -> int:
        return self.padded_vocab_size if self.padded_vocab_size is not None else self.vocab_size

    @property
    def vocab_padding(self) -> int:
        return self.vocab_rows - self.vocab_size

    @property
    def kv_multiplier(self) -> int:
        return self.tp // self.num_kv_heads if self.tp > self.num_kv_heads else 1

    def validate(self) -> None:
        if self.rules is None and self.family not in FAMILIES:
            raise UsageError(f"no sharding rules for model type {self.family!r}")
        if self.tp < 1 or self.pp < 1:
            raise UsageError("--tp and --pp must be at least 1")
        if self.vocab_rows < self.vocab_size:
            raise UsageError(f"padded vocabulary size {self.vocab_rows} is below the vocabulary size {self.vocab_size}")
        if self.vocab_rows % self.tp:
            raise UsageError(f"vocabulary size {self.vocab_rows} is not divisible by --tp {self.tp}")
        if self.num_heads % self.tp:
            raise UsageError(f"{self.num_heads} attention heads are not divisible by --tp {self.tp}")
        if self.tp > self.num_kv_heads and self.tp % self.num_kv_heads:
            raise UsageError(f"--tp {self.tp} is not a multiple of the {self.num_kv_heads} KV heads")
        if self.tp <= self.num_kv_heads and self.num_kv_heads % self.tp:
            raise UsageError(f"{self.num_kv_heads} KV heads are not divisible by --tp {self.tp}")
        if self.pp > self.num_layers:
            raise UsageError(f"--pp {self.pp} is more than the {self.num_layers} layers")
        if self.fuse_qkv and not any(rule_for(self, n) == "q" for n in self.names):
            raise UsageError("--fuse-qkv applies to models with separate q_proj/k_proj/v_proj (Llama-style) only")


def vocab_size_with_padding(vocab_size: int, tp: int, multiple_of: int | None = None) -> int:
    """The smallest size >= vocab_size that both TP and `multiple_of` (when given) divide."""
    if tp < 1 or (multiple_of is not None and multiple_of < 1):
        raise ValueError("tp and multiple_of must be at least 1")
    step = math.lcm(tp, multiple_of or 1)
    return -(-vocab_size // step) * step


def spec_from_config(
    config: dict | None,
    names: list[str],
    tp: int,
    pp: int,
    fuse_qkv: bool,
    dtype: str | None,
    pad_vocab_multiple: int | None = None,
) -> ShardingSpec:
    """The spec of a model from its Hugging Face config (a dict, read through transformers' config class): the
    one `checkpoint migrate` writes and tensor-parallel training uses, with its rules resolved (plans.py)."""
    if config is None:
        raise UsageError(
            "no model config.json found beside the checkpoint: pass --config with the Hugging Face "
            "config (a directory or a config.json)"
        )
    family = config.get("model_type", "")
    rules = resolve_rules(family)
    if rules is None:
        raise UsageError(
            f"no sharding rules for model type {family!r} (no tensor-parallel plan in its transformers config, "
            f"no hand-written table): first tensor without a rule: {names[0] if names else 'none'}"
        )
    unruled = next((n for n in names if _match(rules, n) is None), None)
    if unruled is not None:
        raise UsageError(f"no sharding rule for {family} tensor {unruled!r}")
    cfg = config_object(config)
    heads, hidden = getattr(cfg, "num_attention_heads", None), getattr(cfg, "hidden_size", None)
    if not heads or not hidden:
        raise UsageError(f"the {family} config has no attention head count or hidden size")
    vocab = getattr(cfg, "vocab_size", None) or 0
    spec = ShardingSpec(
        family=family,
        tp=tp,
        pp=pp,
        num_layers=getattr(cfg, "num_hidden_layers", 0) or 0,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or hidden // heads,
        vocab_size=vocab,
        fuse_qkv=fuse_qkv,
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False))
        and not any(n.endswith("lm_head.weight") for n in names),
        dtype=dtype,
        names=list(names),
        padded_vocab_size=vocab_size_with_padding(vocab, tp, pad_vocab_multiple),
        rules=rules,
    )
    spec.validate()
    return spec


def _match(rules: list, name: str) -> str | None:
    return next((rule for pattern, rule in rules if re.search(pattern, name)), None)


def rule_for(spec: ShardingSpec, name: str) -> str:
    rule = _match(spec.table, name)
    if rule is None:
        raise UsageError(f"no sharding rule for {spec.family} tensor {name!r}")
    return rule


def stage_of(spec: ShardingSpec, name: str) -> int:
    """Pipeline stage holding a parameter: layers split contiguously (earlier stages take the remainder);
    everything before the first layer on stage 0, everything after the last on the last stage."""
    m = _LAYER.search("." + name)
    if m:
        layer = int(m.group(1))
        base, extra = divmod(spec.num_layers, spec.pp)
        bound = 0
        for stage in range(spec.pp):
            bound += base + (1 if stage < extra else 0)
            if layer < bound:
                return stage
        return spec.pp - 1
    late = (
        "lm_head",
        "embed_out",
        "pooler",
        "pre_classifier",
        "classifier",
        "cls.",
        "model.norm",
        "final_layer_norm",
        "ln_f.",
        "score.",
    )
    return spec.pp - 1 if any(name.startswith(p) or f".{p}" in name for p in late) or name == "norm.weight" else 0


# -- heads --------------------------------------------------------------------------------------------------


def query_heads_of_rank(spec: ShardingSpec, rank: int) -> list[int]:
    per_rank = spec.num_heads // spec.tp
    if spec.tp <= spec.num_kv_heads:
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    group = spec.num_heads // spec.num_kv_heads  # query heads per KV head in HF grouping
    kv = rank % spec.num_kv_heads
    copy = rank // spec.num_kv_heads  # which of the M ranks sharing this KV head
    start = kv * group + copy * per_rank
    return list(range(start, start + per_rank))


def kv_heads_of_rank(spec: ShardingSpec, rank: int) -> list[int]:
    if spec.tp <= spec.num_kv_heads:
        per_rank = spec.num_kv_heads // spec.tp
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    return [rank % spec.num_kv_heads]


def _rows_of_heads(heads: list[int], head_dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


def neuron_name(spec: ShardingSpec, name: str, rule: str) -> str:
    """The tensor's name in the Neuron (NxD) layout."""
    if rule not in ("q", "k", "v", "gate", "up"):
        return name
    prefix, _, leaf = name.rsplit(".", 2)  # ...self_attn, q_proj, weight|bias
    if rule in ("q", "k", "v"):
        return f"{prefix}.qkv_proj.{leaf}_qkv" if spec.fuse_qkv else f"{prefix}.qkv_proj.{leaf}_{rule}"
    return f"{prefix}.gate_up_proj.{leaf}"


@dataclass(frozen=True)
class Piece:
    """A rank's piece of a tensor: indices [start, stop) of `dim` (the whole tensor when dim is None), then the
    ranges in `more` (a fused tensor's sections: q|k|v, gate|up), concatenated in order, with `zero_rows` zero
    rows appended (vocabulary padding). A reader fetches each range by slice without reading the rest."""

    dim: int | None = None
    start: int = 0
    stop: int = 0
    zero_rows: int = 0
    more: tuple[tuple[int, int], ...] = ()

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return ((self.start, self.stop), *self.more)


PACKED = ("qkv_packed", "conv1d_qkv", "gate_up_packed")


def split_dim(rule: str, ndim: int) -> int:
    """The dim a rule splits: a Linear's output rows (dim 0; dim 1 of 3-D expert weights), its input columns for
    row rules (the last dim); Conv1D's (in, out) weights the other way round."""
    if rule in ("row", "o", "conv1d_column", "conv1d_qkv"):
        return ndim - 1
    if rule == "conv1d_row":
        return 0
    return max(ndim - 2, 0)


def _sections(spec: ShardingSpec, rule: str, size: int) -> list[tuple[int, str, int]]:
    """(offset, rule, size) of the parts a fused tensor's split dim holds: q|k|v, gate|up, or itself."""
    if rule in ("qkv_packed", "conv1d_qkv"):
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        if size != q + 2 * kv:
            raise UsageError(f"a fused q|k|v tensor of {size} rows does not hold {q} + {kv} + {kv} (heads x head_dim)")
        return [(0, "q", q), (q, "k", kv), (q + kv, "v", kv)]
    if rule == "gate_up_packed":
        return [(0, "column", size // 2), (size // 2, "column", size // 2)]
    return [(0, rule, size)]


def _span(spec: ShardingSpec, rule: str, size: int, rank: int) -> tuple[int, int]:
    if rule in ("q", "k", "v", "o"):
        heads = kv_heads_of_rank(spec, rank) if rule in ("k", "v") else query_heads_of_rank(spec, rank)
        return heads[0] * spec.head_dim, (heads[-1] + 1) * spec.head_dim
    if size % spec.tp:
        raise UsageError(f"a dimension of {size} cannot be split {spec.tp} ways (rule {rule})")
    return rank * (size // spec.tp), (rank + 1) * (size // spec.tp)


def piece_of(spec: ShardingSpec, rule: str, shape: tuple[int, ...], rank: int) -> Piece:
    """Where rank `rank`'s piece of a tensor of this shape lies (q/k/v/gate/up pieces are fused by the caller)."""
    if rule == "replicate":
        return Piece()
    dim = split_dim(rule, len(shape))
    if rule == "vocab" and spec.vocab_padding:
        if shape[0] != spec.vocab_size:
            raise UsageError(
                f"a vocabulary tensor of shape {tuple(shape)} does not match the config's "
                f"vocab_size {spec.vocab_size}, so it cannot be padded to {spec.vocab_rows} rows"
            )
        per_rank = spec.vocab_rows // spec.tp
        start = min(rank * per_rank, spec.vocab_size)
        stop = min((rank + 1) * per_rank, spec.vocab_size)
        return Piece(0, start, stop, per_rank - (stop - start))
    try:
        sections = _sections(spec, rule, shape[dim])
        ranges = [(at + a, at + b) for at, sub, size in sections for a, b in [_span(spec, sub, size, rank)]]
    except UsageError as exc:
        raise UsageError(f"a tensor of shape {tuple(shape)} cannot be split by rule {rule!r}: {exc}") from None
    return Piece(dim, *ranges[0], more=tuple(ranges[1:]))


def with_zero_rows(piece: Piece, part: torch.Tensor) -> torch.Tensor:
    """The piece's rows as read, with its zero rows appended."""
    if not piece.zero_rows:
        return part
    return torch.cat([part, part.new_zeros((piece.zero_rows, *part.shape[1:]))], dim=0)


def cut(piece: Piece, tensor: torch.Tensor) -> torch.Tensor:
    """The piece of a full tensor (a view where it is one range and no padding is added)."""
    if piece.dim is None:
        return tensor
    parts = [tensor.narrow(piece.dim, start, stop - start) for start, stop in piece.ranges]
    return with_zero_rows(piece, parts[0] if len(parts) == 1 else torch.cat(parts, dim=piece.dim))


def shard(spec: ShardingSpec, rule: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of a full tensor (q/k/v/gate/up pieces are fused by the caller)."""
    return cut(piece_of(spec, rule, tuple(tensor.shape), rank), tensor)


def _merge_packed(spec: ShardingSpec, rule: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Each rank's ranges put back in place; ranks in reverse, so the first copy of a replicated KV head wins."""
    dim = split_dim(rule, pieces[0].dim())
    shape = list(pieces[0].shape)
    heads = spec.num_heads + 2 * spec.num_kv_heads
    shape[dim] = heads * spec.head_dim if rule != "gate_up_packed" else shape[dim] * spec.tp
    out = pieces[0].new_empty(shape)
    for rank in reversed(range(spec.tp)):
        at = 0
        for start, stop in piece_of(spec, rule, tuple(shape), rank).ranges:
            out.narrow(dim, start, stop - start).copy_(pieces[rank].narrow(dim, at, stop - start))
            at += stop - start
    return out


def merge(spec: ShardingSpec, rule: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's piece, in rank order."""
    if rule == "replicate":
        return pieces[0]
    if rule == "vocab" and spec.vocab_padding:
        full = torch.cat(pieces, dim=0)
        return (
            full[: spec.vocab_size].clone() if full.shape[0] == spec.vocab_rows else refuse_vocab_rows(spec, len(full))
        )
    if rule in PACKED:
        return _merge_packed(spec, rule, pieces)
    dim = split_dim(rule, pieces[0].dim())
    if rule in ("q", "o"):
        shape = list(pieces[0].shape)
        shape[dim] = spec.num_heads * spec.head_dim
        out = torch.empty(shape, dtype=pieces[0].dtype, device=pieces[0].device)
        for rank, piece in enumerate(pieces):
            out.index_copy_(dim, _rows_of_heads(query_heads_of_rank(spec, rank), spec.head_dim), piece)
        return out
    if rule in ("k", "v") and spec.tp > spec.num_kv_heads:
        return torch.cat(pieces[: spec.num_kv_heads], dim=dim)  # rank r < KV holds head r: the first copies
    if rule in ("vocab", "column", "gate", "up", "row", "k", "v", "conv1d_column", "conv1d_row"):
        return torch.cat(pieces, dim=dim)
    raise ValueError(rule)


def refuse_vocab_rows(spec: ShardingSpec, rows: int):
    raise UsageError(f"the shards hold {rows} vocabulary rows, the spec says {spec.vocab_rows}")


def split_fused(spec: ShardingSpec, kind: str, fused: torch.Tensor) -> dict[str, torch.Tensor]:
    """A rank's fused tensor back into its parts: qkv -> q, k, v; gate_up -> gate, up."""
    if kind == "qkv":
        q_rows = spec.num_heads // spec.tp * spec.head_dim
        kv_rows = len(kv_heads_of_rank(spec, 0)) * spec.head_dim
        q, k, v = torch.split(fused, [q_rows, kv_rows, kv_rows], dim=0)
        return {"q": q, "k": k, "v": v}
    gate, up = fused.chunk(2, dim=0)
    return {"gate": gate, "up": up}
