"""YAML recipe -> validated, typed config, with `--set a.b=c` overrides and one-line errors."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from neurontrain.errors import UsageError
from neurontrain.recipe_sft import LoraSpec, SFTDataFields, check_fine_tuning, check_sft, sft_defaults, unset_lora

Task = Literal["sequence-classification", "causal-lm"]
BackendName = Literal["auto", "neuron", "xla-cpu", "xla-cuda", "native", "eager"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    pretrained: str | None = None
    config: dict[str, Any] | None = None
    attn_implementation: Literal["eager", "sdpa"] = "eager"
    num_labels: int = Field(2, ge=1)
    # Hugging Face hub kernels (downloaded code, CUDA only): off unless asked for, whatever transformers' default
    hub_kernels: bool = False
    lora: LoraSpec | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.pretrained is None) == (self.config is None):
            raise ValueError("give exactly one of model.pretrained (path or hub id) or model.config")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs a model_type (for example bert or llama)")
        return self


class WordLevelSpec(_Strict):
    vocab_size: int = Field(2000, ge=16)
    lowercase: bool = True


class TokenizerSpec(_Strict):
    pretrained: str | None = None
    word_level: WordLevelSpec | None = None

    @model_validator(mode="after")
    def _at_most_one(self) -> TokenizerSpec:
        if self.pretrained is not None and self.word_level is not None:
            raise ValueError("give at most one of tokenizer.pretrained or tokenizer.word_level")
        return self


class AutoBucketSpec(_Strict):
    max_buckets: int = Field(6, ge=1, le=64)
    compile_seconds: float | None = Field(None, gt=0)
    flops_per_second: float | None = Field(None, gt=0)
    step_overhead_seconds: float | None = Field(None, ge=0)
    saturation_tokens: int | None = Field(None, ge=0)


DataSource = Literal["synthetic-sentiment", "synthetic-text", "synthetic-chat", "json", "csv", "parquet", "hub", "disk"]


class DataServiceSpec(_Strict):
    """Where batches are made: in the training process (none), or on CPU data nodes of a Ray cluster (ray)."""

    kind: Literal["none", "ray"] = "none"
    address: str | None = None  # the Ray cluster to join; None: RAY_ADDRESS, or `run --local-cluster`
    data_label: str = Field("data", min_length=1)  # node label neurontrain-role of the nodes that make batches
    train_label: str = Field("trainium", min_length=1)  # ... of the nodes the training workers run on
    concurrency: int = Field(1, ge=1)  # collation actors per training worker's stream
    prefetch_batches: int = Field(4, ge=0)  # batches each training worker keeps in flight


class DataSpec(SFTDataFields, _Strict):
    source: DataSource
    path: str | None = None
    name: str | None = None
    split: str = "train"
    eval_split: str | None = None
    text_field: str = "text"
    label_field: str | None = "label"
    train_samples: int | None = Field(None, ge=1)
    eval_samples: int = Field(0, ge=0)
    max_length: int = Field(..., ge=8)
    # a document longer than max_length: cut (truncate), refused (fail), or cut into max_length samples (split);
    # a recipe that does not say gets split for causal LM (no token of the corpus dropped), truncate otherwise
    overlong: Literal["truncate", "fail", "split"] = "truncate"
    batch_size: int = Field(..., ge=1)
    eval_batch_size: int | None = Field(None, ge=1)
    buckets: list[int] | Literal["auto", "max", "dynamic"] = "auto"
    pad_to_multiple_of: int = Field(8, ge=1)
    auto_buckets: AutoBucketSpec = AutoBucketSpec()
    last_batch: Literal["drop", "pad"] = "drop"
    # on: batch_size rows of one length, each filled with whole samples; auto (the default): where the model is
    # proven to isolate documents and the cost model finds packed rows cheaper than the buckets; off: buckets
    packing: Literal["off", "on", "auto"] = "auto"
    max_docs_per_row: int | None = Field(None, ge=1)  # sequence classification under packing; None: from data
    shuffle: bool = True
    seed: int = 0
    service: DataServiceSpec = DataServiceSpec()
    # true: data.path's JSON-lines shards (a directory, a glob, a file or s3://bucket/prefix) are read as a stream
    # and packed on the fly into rows of data.max_length (data/streaming.py); nothing is held whole
    streaming: bool = False

    @field_validator("packing", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare on / off as true / false."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        if self.source in ("json", "csv", "parquet", "hub", "disk") and not self.path:
            raise ValueError(f"data.path is required for source {self.source}")
        if isinstance(self.buckets, list):
            if not self.buckets:
                raise ValueError("data.buckets is empty")
            if any(b < 1 for b in self.buckets):
                raise ValueError("data.buckets must be positive lengths")
            if sorted(set(self.buckets)) != list(self.buckets):
                raise ValueError("data.buckets must be strictly increasing")
            if self.buckets[-1] > self.max_length:
                raise ValueError(f"largest bucket {self.buckets[-1]} exceeds data.max_length {self.max_length}")
        if self.streaming:
            self._check_streaming()
        check_sft(self)
        return self

    def _check_streaming(self) -> None:
        """What a stream cannot honour: its rows are data.max_length long, its documents continue across rows,
        its eval set is the stream's first data.eval_samples documents, and every worker reads it itself."""
        given = self.model_fields_set
        refusals = [
            (self.source != "json", f"reads JSON-lines shards: set data.source: json (got {self.source})"),
            (self.eval_split is not None, "evaluates its first documents: leave data.eval_split unset"),
            (self.train_samples is not None, "reads the stream to its end: leave data.train_samples unset"),
            (self.buckets not in ("auto", "max"), "packs rows of data.max_length: leave data.buckets unset"),
            ("packing" in given and self.packing == "off", "packs rows: data.packing: off contradicts it"),
            ("overlong" in given and self.overlong != "split", "cuts no document: leave data.overlong unset"),
            (self.max_docs_per_row is not None, "packs causal-LM rows: leave data.max_docs_per_row unset"),
            (self.service.kind != "none", "is read by every worker itself: data.service.kind must be none"),
        ]
        for refused, message in refusals:
            if refused:
                raise ValueError(f"data.streaming {message}")


class OptimizerSpec(_Strict):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(..., gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)


class ScheduleSpec(_Strict):
    kind: Literal["constant", "linear", "cosine"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class TrainSpec(_Strict):
    max_steps: int = Field(..., ge=1)
    grad_accum: int = Field(1, ge=1)
    global_batch_size: int | None = Field(None, ge=1)  # samples per optimizer step over all workers
    max_grad_norm: float | None = Field(1.0, gt=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0)
    eval_at_end: bool = True
    seed: int = 0
    recompile_guard: Literal["warn", "fail", "off"] = "warn"
    # auto: the memory planner decides (make_plan resolves both to concrete values before anything reads them)
    zero1: Literal["auto"] | bool = "auto"  # optimizer state sharded across the data-parallel workers
    # none | full (every layer) | every_N (every N-th layer) | auto
    activation_checkpointing: str = Field("auto", pattern=r"^(auto|none|full|every_[1-9][0-9]*)$")
    optimizer: OptimizerSpec
    schedule: ScheduleSpec = ScheduleSpec()


class CheckpointSpec(_Strict):
    every: int = Field(0, ge=0)
    keep: int = Field(3, ge=1)
    resume: bool = True
    save_final: bool = True


class RuntimeSpec(_Strict):
    backend: BackendName = "auto"
    loader: Literal["mp_device_loader", "simple"] = "mp_device_loader"
    compile_cache: str = "compile_cache"
    preflight: bool = True  # device checks (and, with several workers, collectives) before training
    expected_devices: int | None = Field(None, ge=1)  # devices each worker must see; checked by preflight
    compiler_flags: list[str] = []  # neuronx-cc flags: appended to NEURON_CC_FLAGS for the Neuron runtime only
    xla_flags: list[str] = []  # XLA flags (--xla_...): appended to XLA_FLAGS, checked against XLA first
    neuron_target: Literal["auto", "trn1", "trn2", "trn3"] = "auto"  # auto: the runtime's own (the host's)
    collective_timeout: float = Field(600.0, gt=0)  # seconds a worker waits in a collective or barrier
    device_memory_gib: float | None = Field(None, gt=0)  # one core's memory for the planner (default: the target's)
    # float32 matmuls (torch.set_float32_matmul_precision, set once per process): "high" lets CUDA use TF32
    matmul_precision: Literal["highest", "high", "medium"] = "highest"
    # native: torch.compile(fullgraph=...); None: the device target's default (TorchNeuron's docs recommend True)
    fullgraph: bool | None = None


class ParallelSpec(_Strict):
    tp: Literal["auto"] | int = "auto"  # tensor-parallel degree (Neuron, through neuronx-distributed)
    # native backend, several workers: FSDP2 (fully_shard) shards parameters, gradients and AdamW state by layer
    fsdp: bool = False
    # pipeline stages (auto: the memory planner adds stages once tensor parallel at its largest does not fit);
    # a step's micro-batches through the pipeline are train.grad_accum (or global_batch_size's share)
    pp: Literal["auto"] | int = "auto"

    @model_validator(mode="after")
    def _positive(self) -> ParallelSpec:
        if self.tp != "auto" and self.tp < 1:
            raise ValueError(f"parallel.tp must be auto or a positive integer (got {self.tp})")
        if self.pp != "auto" and self.pp < 1:
            raise ValueError(f"parallel.pp must be auto or a positive integer (got {self.pp})")
        return self


class ClusterGroup(_Strict):
    name: str = Field(..., min_length=1)
    role: Literal["data", "trainium"]
    instance_type: str | None = None
    count: int = Field(1, ge=1)


class ClusterSpec(_Strict):
    """The instance groups of a heterogeneous job and their roles (the launchers read it)."""

    groups: list[ClusterGroup] = []

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"cluster.groups: names must differ (got {names})")
        if self.groups and {g.role for g in self.groups} != {"data", "trainium"}:
            raise ValueError("cluster.groups: a heterogeneous cluster needs a data group and a trainium group")
        return self


class Recipe(_Strict):
    name: str
    task: Task
    model: ModelSpec
    tokenizer: TokenizerSpec = TokenizerSpec()
    data: DataSpec
    train: TrainSpec
    checkpoint: CheckpointSpec = CheckpointSpec()
    runtime: RuntimeSpec = RuntimeSpec()
    parallel: ParallelSpec = ParallelSpec()
    cluster: ClusterSpec = ClusterSpec()

    @model_validator(mode="before")
    @classmethod
    def _overlong_for_task(cls, values: Any) -> Any:
        data = values.get("data") if isinstance(values, dict) else None
        if isinstance(data, dict) and "overlong" not in data and values.get("task") == "causal-lm":
            return values | {"data": data | {"overlong": "split"}}
        return values

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        check_fine_tuning(self)
        if self.data.streaming and self.task != "causal-lm":
            raise ValueError(f"data.streaming packs documents into causal-LM rows: task {self.task} does not stream")
        if self.task == "sequence-classification" and self.data.overlong == "split":
            raise ValueError(
                "data.overlong: split makes several samples of one document, which a sequence label cannot follow "
                "(use truncate or fail for sequence-classification)"
            )
        if self.task == "sequence-classification" and not self.data.label_field:
            raise ValueError("task sequence-classification needs data.label_field")
        if self.tokenizer.pretrained is None and self.tokenizer.word_level is None and self.model.pretrained is None:
            raise ValueError("a model built from model.config needs tokenizer.pretrained or tokenizer.word_level")
        if self.train.schedule.warmup_steps >= self.train.max_steps and self.train.schedule.warmup_steps > 0:
            raise ValueError("train.schedule.warmup_steps must be smaller than train.max_steps")
        return self

    def fingerprint(self) -> str:
        """Hash of everything that changes the computation (used to refuse resuming a different run). Settings
        added later are left out at their default, so older checkpoints and compile caches keep their hash."""
        unset_later = {"packing", "max_docs_per_row"} if self.data.packing == "off" else set()
        unset_later |= {"service"}  # where batches are made changes no batch
        unset_later |= set() if self.data.streaming else {"streaming"}
        unset_later |= sft_defaults(self.data)
        payload = self.model_dump(
            mode="json",
            exclude={
                "model": set() if self.model.lora is not None else {"lora"},
                "data": unset_later,
                "checkpoint": True,
                "train": {"max_steps", "log_every", "zero1", "activation_checkpointing"},
                "parallel": {"fsdp"},  # how the same computation is laid out over workers, as zero1
                "cluster": True,
                "runtime": {
                    "compile_cache",
                    "preflight",
                    "expected_devices",
                    "collective_timeout",
                    "device_memory_gib",
                },
            },
        )
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def model_fingerprint(self) -> str:
        """Hash of what the model is: its architecture or checkpoint, labels and tokenizer (`compare` refuses
        runs of different models)."""
        payload = self.model_dump(mode="json", include={"task", "model", "tokenizer"}, exclude=unset_lora(self))
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def data_fingerprint(self) -> str:
        """Hash of which samples a run trains and evaluates on (not how they are batched or bucketed)."""
        fields = {"source", "path", "name", "split", "eval_split", "text_field", "label_field", "train_samples"}
        fields |= {"eval_samples", "max_length", "overlong", "shuffle", "seed"} | (
            {"streaming"} if self.data.streaming else set()
        )
        fields |= {"format", "loss_on", "chat_template"} - sft_defaults(self.data)
        payload = self.data.model_dump(mode="json", include=fields)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"] if not str(p).startswith("function-after"))
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            msg = "unknown key"
        elif item["type"] == "missing":
            msg = "required key is missing"
        elif "input" in item and not isinstance(item["input"], (dict, list)):
            msg = f"{msg} (got {item['input']!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def parse_override(expr: str) -> tuple[list[str], Any]:
    """`a.b.c=VALUE` -> (["a","b","c"], VALUE parsed as YAML)."""
    key, sep, raw = expr.partition("=")
    path = key.strip().split(".")
    if not sep or not key.strip() or any(not p for p in path):
        raise UsageError(f"bad --set {expr!r}: expected KEY.PATH=VALUE, for example train.max_steps=20")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise UsageError(f"bad --set {expr!r}: the value is not valid YAML") from None
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    data = copy.deepcopy(raw)
    for expr in overrides:
        path, value = parse_override(expr)
        node = data
        for depth, key in enumerate(path[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                raise UsageError(f"bad --set {expr!r}: {where} is not a mapping")
            node = child
        node[path[-1]] = value
    return data


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    path = Path(path)
    if not path.exists():
        raise UsageError(f"recipe not found: {path}")
    if not path.is_file():
        raise UsageError(f"recipe is not a file: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"recipe {path}: not valid YAML{where}") from None
    except UnicodeDecodeError:
        raise UsageError(f"recipe {path}: not a text file") from None
    if raw is None:
        raise UsageError(f"recipe {path}: empty")
    if not isinstance(raw, dict):
        raise UsageError(f"recipe {path}: top level must be a mapping, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    try:
        return Recipe.model_validate(raw)
    except ValidationError as err:
        raise UsageError(f"recipe {path}: {_format_validation_error(err)}") from None
