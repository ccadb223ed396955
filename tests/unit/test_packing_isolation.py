"""Sequence packing on eager CPU (issue 15's isolation and equivalence tests; XLA:CPU in
tests/integration/test_packing_xla.py), per model family of tests/families.py that the set-up lets pack: in a
packed row, changing one document's tokens leaves every other document's outputs bit-identical, and each
document's logits and loss equal those of the document run alone. Batches come from the real batcher and
Collator, outputs from the training loop's forward pass."""

import pytest
from families import DECODERS, ENCODERS
from packing_models import (
    LENGTHS,
    MAX_DOCS,
    ROW_LENGTH,
    dims_of,
    documents,
    equivalence,
    first_documents,
    isolation,
    pack,
    tiny_model,
)

from neurontrain.backends import select_backend

# The families whose per-document masking the set-up finds equivalent (model/input_probe.py); the rest refused
PACKED = (*DECODERS, "bert", "roberta", "distilbert")
REFUSED = {"deberta-v2": "does not honour a 4D additive attention mask"}
# Every family under eager attention; under sdpa the families the tests covered before (Gemma 2 has no sdpa)
SDPA = ("llama", "mistral", "qwen2", "gpt2", "bert", "roberta", "distilbert")
PARAMS = [(t, "eager") for t in PACKED] + [(t, "sdpa") for t in SDPA]
# A mixture of experts multiplies each expert's tokens of the whole batch together: another document's tokens
# change the grouping and so the rounding (not what a token attends to: the erased-boundaries check still
# differs by more than 1e-2)
ROUNDING = {"mixtral": 1e-5}


@pytest.fixture(scope="module")
def backend():
    return select_backend("eager")


@pytest.fixture(scope="module", params=PARAMS, ids="-".join)
def model(request):
    return tiny_model(*request.param)


def test_the_families_that_pack_are_those_the_set_up_finds_equivalent():
    assert sorted([*PACKED, *REFUSED]) == sorted([*DECODERS, *ENCODERS])
    for model_type in PACKED:
        assert dims_of(tiny_model(model_type)).inputs.unpackable is None, model_type
    for model_type, reason in REFUSED.items():
        assert reason in dims_of(tiny_model(model_type)).inputs.unpackable


def test_the_rows_hold_several_documents_and_end_in_padding():
    tokens, labels = documents()
    for task in ("causal-lm", "sequence-classification"):
        packed = pack(tokens, labels, task)
        rows = {p.row for p in packed.places.values()}
        assert sorted(packed.places) == list(range(len(LENGTHS))) and rows == {0, 1}
        for row in rows:
            places = [p for p in packed.places.values() if p.row == row]
            assert 2 < len(places) < MAX_DOCS
            assert sum(p.length for p in places) < ROW_LENGTH
            assert packed.batch["document_ids"][row, -1] == 0


def test_changing_one_document_leaves_the_others_bit_identical(model, backend):
    results = isolation(model, backend)
    assert [r.changed for r in results] == list(range(len(LENGTHS)))  # first, middle and last of both rows
    bound = ROUNDING.get(model.config.model_type, 0.0)
    for result in results:
        assert result.max_diff <= bound and (result.equal or bound), result


def test_without_document_boundaries_a_changed_document_reaches_the_others(model, backend):
    """The check above can fail: with each row one document (a plain padding mask), changing a row's first
    document changes what the row's later documents get."""
    for result in isolation(model, backend, first_documents(), erase_boundaries=True):
        assert not result.equal and result.max_diff > 1e-2, result


def test_packed_documents_match_each_document_run_alone(model, backend):
    diffs = equivalence(model, backend)
    assert max(diffs.values()) <= 1e-5, diffs


def test_without_document_boundaries_packed_documents_differ_from_alone(model, backend):
    """The check above can fail: with a plain padding mask, later documents see earlier ones."""
    diffs = equivalence(model, backend, erase_boundaries=True)
    assert diffs["logits"] > 1e-2 and diffs["batch_loss"] > 1e-4, diffs
