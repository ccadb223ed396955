"""Tensor-parallel and pipeline-parallel sharding rules, as data, and the pure functions that apply them.

A model family is a list of (pattern, rule) pairs over Hugging Face parameter names; the first match wins.
Rules:
  replicate   every TP rank holds the whole tensor
  vocab       split on dim 0 (embeddings, lm_head: vocabulary-parallel), zero-padded to padded_vocab_size
  column      split on dim 0 (column-parallel weights and their biases)
  row         split on dim 1 (row-parallel weights; their biases are replicated)
  q / k / v   attention projections, split by heads with GQA awareness (see below); may be fused
  o           attention output, split on dim 1 by the query heads each rank holds
  gate / up   MLP projections, column-parallel and concatenated per rank into `gate_up_proj`

GQA (Neuron's layout): with TP > KV heads, M = TP / KV copies of each KV head are made (`full.repeat(M, 1)`)
so rank r holds KV head r mod KV, and the query heads are permuted so each rank holds the query heads that
use its KV head under Hugging Face's grouping (and o_proj's matching columns). With TP <= KV heads, heads
are split contiguously and no permutation is needed. Merging keeps the first copy of each KV head.

Vocabulary padding (as Megatron and NxD's parallel embedding do): when TP does not divide the vocabulary,
or a multiple is asked for, vocab-split tensors get zero rows appended up to the padded size before the
split; merging drops them again, whatever training wrote into them.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import torch

from neurontrain.errors import UsageError

LLAMA_RULES: list[tuple[str, str]] = [
    (r"(^|\.)embed_tokens\.weight$", "vocab"),
    (r"(^|\.)lm_head\.weight$", "vocab"),
    (r"\.self_attn\.q_proj\.weight$", "q"),
    (r"\.self_attn\.k_proj\.weight$", "k"),
    (r"\.self_attn\.v_proj\.weight$", "v"),
    (r"\.self_attn\.o_proj\.weight$", "o"),
    (r"\.mlp\.gate_proj\.weight$", "gate"),
    (r"\.mlp\.up_proj\.weight$", "up"),
    (r"\.mlp\.down_proj\.weight$", "row"),
    (r"norm\.weight$", "replicate"),
]

BERT_RULES: list[tuple[str, str]] = [
    (r"embeddings\.word_embeddings\.weight$", "vocab"),
    (r"embeddings\.(position_embeddings|token_type_embeddings)\.weight$", "replicate"),
    (r"attention\.self\.(query|key|value)\.(weight|bias)$", "column"),
    (r"attention\.output\.dense\.weight$", "row"),
    (r"intermediate\.dense\.(weight|bias)$", "column"),
    (r"layer\.\d+\.output\.dense\.weight$", "row"),
    (r"LayerNorm\.(weight|bias)$", "replicate"),
    (r"(attention\.output|layer\.\d+\.output)\.dense\.bias$", "replicate"),
    (r"(pooler|classifier|cls)\..*$", "replicate"),
]

FAMILIES = {"llama": LLAMA_RULES, "mistral": LLAMA_RULES, "qwen2": LLAMA_RULES, "bert": BERT_RULES}
_LAYER = re.compile(r"\.layers?\.(\d+)\.")


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

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ShardingSpec:
        return cls(**data)

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
        if self.family not in FAMILIES:
            raise UsageError(f"no sharding rules for model type {self.family!r} (known: {', '.join(sorted(FAMILIES))})")
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
        if self.fuse_qkv and self.family == "bert":
            raise UsageError("--fuse-qkv applies to decoder (Llama-style) models only")


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
    """The spec of a model from its Hugging Face config (a dict): the one `checkpoint migrate` writes and
    tensor-parallel training uses."""
    if config is None:
        raise UsageError(
            "no model config.json found beside the checkpoint: pass --config with the Hugging Face "
            "config (a directory or a config.json)"
        )
    family = config.get("model_type", "")
    heads = config.get("num_attention_heads")
    if not heads or "hidden_size" not in config:
        raise UsageError("the model config lacks num_attention_heads or hidden_size")
    kv = config.get("num_key_value_heads") or heads
    layers = config.get("num_hidden_layers", 0)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    tied = bool(config.get("tie_word_embeddings", family != "bert")) and not any(
        n.endswith("lm_head.weight") for n in names
    )
    vocab = config.get("vocab_size") or 0
    spec = ShardingSpec(
        family=family,
        tp=tp,
        pp=pp,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=vocab,
        fuse_qkv=fuse_qkv,
        tied_embeddings=tied,
        dtype=dtype,
        names=list(names),
        padded_vocab_size=vocab_size_with_padding(vocab, tp, pad_vocab_multiple),
    )
    spec.validate()
    return spec


def rule_for(spec: ShardingSpec, name: str) -> str:
    for pattern, rule in FAMILIES[spec.family]:
        if re.search(pattern, name):
            return rule
    raise UsageError(f"no sharding rule for tensor {name!r} ({spec.family})")


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
    late = ("lm_head", "pooler", "classifier", "cls.", "model.norm", "final_layer_norm")
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
    if rule in ("q", "k", "v"):
        prefix = name.rsplit(".", 2)[0]  # ...self_attn
        return f"{prefix}.qkv_proj.weight_qkv" if spec.fuse_qkv else f"{prefix}.qkv_proj.weight_{rule}"
    if rule in ("gate", "up"):
        return name.rsplit(".", 2)[0] + ".gate_up_proj.weight"
    return name


@dataclass(frozen=True)
class Piece:
    """A rank's piece of a tensor: indices [start, stop) of `dim` (the whole tensor when dim is None), with
    `zero_rows` zero rows appended (vocabulary padding). Every rule's piece is one contiguous range, so a reader
    can fetch it without reading the rest of the tensor."""

    dim: int | None = None
    start: int = 0
    stop: int = 0
    zero_rows: int = 0


def piece_of(spec: ShardingSpec, rule: str, shape: tuple[int, ...], rank: int) -> Piece:
    """Where rank `rank`'s piece of a tensor of this shape lies (q/k/v/gate/up pieces are fused by the caller)."""
    tp = spec.tp
    if rule == "replicate":
        return Piece()
    if rule == "vocab" and spec.vocab_padding:
        if shape[0] != spec.vocab_size:
            raise UsageError(
                f"a vocabulary tensor of shape {tuple(shape)} does not match the config's "
                f"vocab_size {spec.vocab_size}, so it cannot be padded to {spec.vocab_rows} rows"
            )
        per_rank = spec.vocab_rows // tp
        start = min(rank * per_rank, spec.vocab_size)
        stop = min((rank + 1) * per_rank, spec.vocab_size)
        return Piece(0, start, stop, per_rank - (stop - start))
    if rule in ("vocab", "column", "gate", "up", "row"):
        dim = 1 if rule == "row" else 0
        if shape[dim] % tp:
            raise UsageError(f"a tensor of shape {tuple(shape)} cannot be split {tp} ways on dim {dim}")
        size = shape[dim] // tp
        return Piece(dim, rank * size, (rank + 1) * size)
    if rule in ("q", "k", "v", "o"):
        heads = kv_heads_of_rank(spec, rank) if rule in ("k", "v") else query_heads_of_rank(spec, rank)
        return Piece(1 if rule == "o" else 0, heads[0] * spec.head_dim, (heads[-1] + 1) * spec.head_dim)
    raise ValueError(rule)


def with_zero_rows(piece: Piece, part: torch.Tensor) -> torch.Tensor:
    """The piece's rows as read, with its zero rows appended."""
    if not piece.zero_rows:
        return part
    return torch.cat([part, part.new_zeros((piece.zero_rows, *part.shape[1:]))], dim=0)


def cut(piece: Piece, tensor: torch.Tensor) -> torch.Tensor:
    """The piece of a full tensor (a view where no padding is added)."""
    if piece.dim is None:
        return tensor
    return with_zero_rows(piece, tensor.narrow(piece.dim, piece.start, piece.stop - piece.start))


def shard(spec: ShardingSpec, rule: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of a full tensor (q/k/v/gate/up pieces are fused by the caller)."""
    return cut(piece_of(spec, rule, tuple(tensor.shape), rank), tensor)


def merge(spec: ShardingSpec, rule: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's piece, in rank order."""
    if rule == "replicate":
        return pieces[0]
    if rule == "vocab" and spec.vocab_padding:
        full = torch.cat(pieces, dim=0)
        if full.shape[0] != spec.vocab_rows:
            raise UsageError(f"the shards hold {full.shape[0]} vocabulary rows, the spec says {spec.vocab_rows}")
        return full[: spec.vocab_size].clone()
    if rule in ("vocab", "column", "gate", "up"):
        return torch.cat(pieces, dim=0)
    if rule == "row":
        return torch.cat(pieces, dim=1)
    if rule in ("q", "o"):
        dim = 0 if rule == "q" else 1
        n_heads = spec.num_heads
        shape = list(pieces[0].shape)
        shape[dim] = n_heads * spec.head_dim
        out = torch.empty(shape, dtype=pieces[0].dtype)
        for rank, piece in enumerate(pieces):
            out.index_copy_(dim, _rows_of_heads(query_heads_of_rank(spec, rank), spec.head_dim), piece)
        return out
    if rule in ("k", "v"):
        if spec.tp <= spec.num_kv_heads:
            return torch.cat(pieces, dim=0)
        return torch.cat(pieces[: spec.num_kv_heads], dim=0)  # rank r < KV holds head r: the first copies
    raise ValueError(rule)


def split_fused(spec: ShardingSpec, kind: str, fused: torch.Tensor) -> dict[str, torch.Tensor]:
    """A rank's fused tensor back into its parts: qkv -> q, k, v; gate_up -> gate, up."""
    if kind == "qkv":
        q_rows = spec.num_heads // spec.tp * spec.head_dim
        kv_rows = len(kv_heads_of_rank(spec, 0)) * spec.head_dim
        q, k, v = torch.split(fused, [q_rows, kv_rows, kv_rows], dim=0)
        return {"q": q, "k": k, "v": v}
    gate, up = fused.chunk(2, dim=0)
    return {"gate": gate, "up": up}
