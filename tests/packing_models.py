"""Tiny models and packed batches for the sequence-packing tests (tests/unit/test_packing_isolation.py, and on
XLA:CPU tests/packing_xla_worker.py).

Six documents of several lengths are packed by the real batcher (`fixed_batches` with a `Packing`) into two rows
with padding at the end of each, and collated by the real `Collator`; the model runs through the training loop's
`forward`. Where each document sits is read from the batch's document ids, not recomputed. Outputs come back to
the host before they are compared, so the same checks run on eager CPU and on an XLA device.
"""

from dataclasses import dataclass

import torch
from families import ENCODERS, tiny_config

from neurontrain.backends import Backend
from neurontrain.data.batching import IndexBatch, fixed_batches
from neurontrain.data.collate import IGNORE_INDEX, Collator
from neurontrain.data.packing import Packing
from neurontrain.loop.steps import forward
from neurontrain.model.build import SPECIAL_IDS, ModelDims
from neurontrain.model.input_probe import probe_model_inputs
from neurontrain.model.packed import packed_hidden_states

CLM, CLS = "causal-lm", "sequence-classification"
ROW_LENGTH, ROWS, MAX_DOCS, VOCAB, PAD_ID, NUM_LABELS = 32, 2, 4, 96, 0, 3
# Best-fit decreasing packs these into rows of samples (2, 0, 3) and (1, 4, 5): 31 and 24 of 32 slots, so both
# rows end in padding, and each row leaves one of MAX_DOCS document slots empty.
LENGTHS = (12, 9, 14, 5, 8, 7)
SIZES = {"vocab_size": VOCAB, "max_position_embeddings": 2 * ROW_LENGTH, "initializer_range": 0.2}


def task_of(model_type: str) -> str:
    return CLS if model_type in ENCODERS else CLM


def tiny_model(model_type: str, attn_implementation: str = "eager") -> torch.nn.Module:
    """A seeded 2-layer model of the family (tests/families.py: its config class's defaults, small sizes) in eval
    mode (no dropout): a sequence classifier for the encoders, a causal LM for the others; its pad id PAD_ID and
    special ids outside the vocabulary unset. Weights at std 0.2, not 0.02, so outputs are of order one and 1e-5
    is a tight bound."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification  # lazy: slow

    config = tiny_config(model_type, **SIZES)
    for name in SPECIAL_IDS:
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= VOCAB:
            setattr(config, name, None)
    config.pad_token_id = PAD_ID
    if task_of(model_type) == CLS:
        config.num_labels = NUM_LABELS
        auto = AutoModelForSequenceClassification
    else:
        auto = AutoModelForCausalLM
    torch.manual_seed(0)
    return auto.from_config(config, attn_implementation=attn_implementation).eval()


def dims_of(model: torch.nn.Module) -> ModelDims:
    """The loop's dims of the model, its inputs as the run's set-up decides them."""
    config = model.config
    task = task_of(config.model_type)
    inputs = probe_model_inputs(config, task, config._attn_implementation)
    return ModelDims(config.model_type, 0, 2, config.hidden_size, is_encoder=task == CLS, inputs=inputs)


def documents(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Token ids (never the pad id) of LENGTHS, and a class label per document."""
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]
    labels = torch.randint(0, NUM_LABELS, (len(LENGTHS),), generator=generator).tolist()
    return tokens, labels


def replaced(tokens: list[list[int]], sample: int, seed: int = 1) -> list[list[int]]:
    """`tokens` with the document of `sample` changed at every position (same length, so the rows keep their
    boundaries)."""
    generator = torch.Generator().manual_seed(seed)
    shifts = torch.randint(1, VOCAB - 1, (len(tokens[sample]),), generator=generator).tolist()
    changed = [(token - 1 + shift) % (VOCAB - 1) + 1 for token, shift in zip(tokens[sample], shifts, strict=True)]
    return [changed if i == sample else list(t) for i, t in enumerate(tokens)]


@dataclass(frozen=True)
class Place:
    row: int
    slot: int  # the document's number in its row, from 0
    start: int
    length: int


@dataclass(frozen=True)
class Packed:
    task: str
    batch: dict  # what the Collator gives
    places: dict[int, Place]  # sample -> where the collated batch holds it


def pack(tokens: list[list[int]], labels: list[int], task: str) -> Packed:
    (plan,) = fixed_batches([len(t) for t in tokens], ROWS, None, packing=Packing(ROW_LENGTH, MAX_DOCS))
    batch = Collator(tokens, labels, task, ROWS, PAD_ID, max_docs=MAX_DOCS)(plan)
    places = {}
    for row, samples in enumerate(plan.rows):
        for slot, sample in enumerate(samples):
            (at,) = torch.nonzero(batch["document_ids"][row] == slot + 1, as_tuple=True)
            place = Place(row, slot, int(at[0]), len(at))
            assert at.tolist() == list(range(place.start, place.start + place.length)), "a document is not contiguous"
            assert batch["input_ids"][row, at].tolist() == tokens[sample]
            places[sample] = place
    return Packed(task, batch, places)


def first_documents() -> tuple[int, ...]:
    """The samples that open a row: with the boundaries erased, changing one reaches the row's later documents
    in a decoder too."""
    tokens, labels = documents()
    return tuple(sample for sample, p in pack(tokens, labels, CLM).places.items() if p.slot == 0)


def _run(model: torch.nn.Module, batch: dict, backend: Backend, extra: tuple = ()) -> list[torch.Tensor]:
    """The training loop's forward pass in fp32 on the backend's device: [logits, loss] and, for each name in
    `extra` ("hidden": an encoder's last hidden states), that output, on the host."""
    dims = dims_of(model)
    names = [k for k, v in batch.items() if isinstance(v, torch.Tensor)]
    on_device = dict(zip(names, backend.to_device([batch[k] for k in names]), strict=True))
    with torch.no_grad():
        out = forward(model, on_device, dims, backend.autocast, "fp32")
        tensors = [out.logits, out.loss]
        if "hidden" in extra:
            tensors.append(packed_hidden_states(model, on_device, torch.float32, dims.inputs.position_offset))
    backend.sync()
    return backend.to_host(tensors)


def packed_outputs(
    model: torch.nn.Module, packed: Packed, backend: Backend, erase_boundaries: bool = False
) -> tuple[dict[int, dict[str, torch.Tensor]], torch.Tensor]:
    """Each document's outputs from one packed forward pass, on the host: a causal LM's per-token logits; an encoder's
    per-document logits and per-token last hidden states. With erase_boundaries every row is one document
    (a plain padding mask), which must break isolation. Also the batch's loss."""
    batch = packed.batch
    if erase_boundaries:
        batch = batch | {"document_ids": (batch["document_ids"] != 0).long()}
    if packed.task == CLS:
        logits, loss, hidden = _run(model, batch, backend, extra=("hidden",))
        per_token = {"hidden": hidden}
    else:
        logits, loss = _run(model, batch, backend)
        per_token = {"logits": logits}
    per_doc = {}
    for sample, p in packed.places.items():
        per_doc[sample] = {name: t[p.row, p.start : p.start + p.length] for name, t in per_token.items()}
        if packed.task == CLS:
            per_doc[sample]["logits"] = logits[p.row, p.slot]
    return per_doc, loss


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@dataclass(frozen=True)
class Isolation:
    changed: int  # the sample whose tokens changed
    equal: bool  # every output of every other document bit-identical
    max_diff: float  # the largest |difference| among them


def isolation(
    model: torch.nn.Module, backend: Backend, samples: tuple[int, ...] = tuple(range(len(LENGTHS))), **kw
) -> list[Isolation]:
    """For each sample of `samples`: change its tokens only and compare the outputs of every other document."""
    tokens, labels = documents()
    task = task_of(model.config.model_type)
    before, _ = packed_outputs(model, pack(tokens, labels, task), backend, **kw)
    results = []
    for changed in samples:
        after, _ = packed_outputs(model, pack(replaced(tokens, changed), labels, task), backend, **kw)
        pairs = [(before[s][k], after[s][k]) for s in before if s != changed for k in before[s]]
        equal = all(torch.equal(a, b) for a, b in pairs)
        results.append(Isolation(changed, equal, max(_max_diff(a, b) for a, b in pairs)))
    return results


def _alone(
    model: torch.nn.Module, tokens: list[list[int]], labels: list[int], sample: int, backend: Backend
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss) of the sample as an unpacked batch of one: no padding, no document ids, default
    positions."""
    collate = Collator(tokens, labels, task_of(model.config.model_type), 1, PAD_ID)
    logits, loss = _run(model, collate(IndexBatch(len(tokens[sample]), (sample,))), backend)
    return logits[0], loss


def _document_loss(packed: Packed, per_doc: dict, sample: int) -> torch.Tensor:
    """The packed run's loss of one document from its slice of the packed logits and labels: next-token cross
    entropy within the document (causal LM), or its slot's cross entropy (classification)."""
    p, labels = packed.places[sample], packed.batch["labels"]
    logits = per_doc[sample]["logits"]
    if packed.task == CLS:
        return torch.nn.functional.cross_entropy(logits[None], labels[p.row, p.slot][None])
    targets = labels[p.row, p.start + 1 : p.start + p.length]
    return torch.nn.functional.cross_entropy(logits[:-1], targets, ignore_index=IGNORE_INDEX)


def equivalence(model: torch.nn.Module, backend: Backend, erase_boundaries: bool = False) -> dict[str, float]:
    """Largest |packed - unpacked| over the documents: their logits, their own losses, and the batch loss
    against the unpacked losses' mean (weighted by predicted tokens for a causal LM, by document otherwise)."""
    tokens, labels = documents()
    packed = pack(tokens, labels, task_of(model.config.model_type))
    per_doc, batch_loss = packed_outputs(model, packed, backend, erase_boundaries)
    logits, losses, weights = [], [], []
    for sample in per_doc:
        unpacked_logits, unpacked_loss = _alone(model, tokens, labels, sample, backend)
        logits.append(_max_diff(per_doc[sample]["logits"], unpacked_logits))
        losses.append((_document_loss(packed, per_doc, sample), unpacked_loss))
        weights.append(len(tokens[sample]) - 1 if packed.task == CLM else 1)
    assert sum(weights) == packed.batch["loss_items"]
    unpacked_mean = sum(w * loss for w, (_, loss) in zip(weights, losses, strict=True)) / sum(weights)
    return {
        "logits": max(logits),
        "document_loss": max(_max_diff(a, b) for a, b in losses),
        "batch_loss": _max_diff(batch_loss, unpacked_mean),
    }
