"""Fuzzing the metadata file and the storage files of a real checkpoint (hypothesis, short budget).

Every case loads a mutated copy of a small saved checkpoint; the only acceptable outcomes
are a load that returns exactly what the (mutated) metadata describes or a named
CheckpointError (tests/fuzz/checkpoint.py holds the oracle). Byte-level edits of the
metadata must be caught by its checksum; structured edits are re-sealed with the library's
encoder, so they reach the field validation and the load's coverage checks.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bytecheckpoint.format.metadata import METADATA_FILE
from tests.fuzz import corpus, session
from tests.fuzz.cases import run
from tests.fuzz.mutate import apply_bytes
from tests.fuzz.outcomes import NAMED
from tests.fuzz.strategies import byte_ops, doc_ops, fuzz_settings

pytestmark = pytest.mark.fuzz

_CTX = session.context  # built on first use, shared with the other fuzz files
_META_SIZE = len(_CTX().seed.files[METADATA_FILE])
_STORAGE = sorted(n for n in _CTX().seed.files if n != METADATA_FILE)


@fuzz_settings(80)
@given(byte_ops(_META_SIZE))
def test_byte_edits_of_the_metadata_are_refused_by_name(ops):
    case = ["metadata_ops", ops]
    result = run(case, _CTX())
    session.check(result, case)
    # The checksum covers every byte: any edit that changes the file is a named refusal.
    original = _CTX().seed.files[METADATA_FILE]
    if apply_bytes(original, ops) != original:
        assert result.kind == NAMED, result


@fuzz_settings(120)
@given(st.data())
def test_resealed_field_edits_load_exactly_or_are_refused_by_name(data):
    case = ["doc_ops", data.draw(doc_ops(_CTX().seed.doc))]
    session.check(run(case, _CTX()), case)


@fuzz_settings(50)
@given(st.data())
def test_storage_file_edits_load_exactly_or_are_refused_by_name(data):
    name = data.draw(st.sampled_from(_STORAGE))
    size = len(_CTX().seed.files[name])
    case = ["storage_ops", name, data.draw(byte_ops(size))]
    session.check(run(case, _CTX()), case)


@fuzz_settings(30)
@given(st.data())
def test_verify_reports_every_storage_file_edit_that_changes_what_it_says(data):
    name = data.draw(st.sampled_from(_STORAGE))
    data_bytes = _CTX().seed.files[name]
    header_end = 8 + int.from_bytes(data_bytes[:8], "little")
    # Half the edits land in the safetensors header: a same-length dtype or offset edit there
    # must be reported like a payload edit.
    lo, hi = data.draw(st.sampled_from(((0, header_end), (header_end, len(data_bytes)))))
    case = ["verify_ops", name, data.draw(byte_ops(len(data_bytes), lo, hi))]
    session.check(run(case, _CTX()), case)


@pytest.mark.parametrize("name,case", corpus.load("metadata", "doc", "storage", "verify"),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_corpus(name, case):
    """The seeded corpus and the named reproducers of issue 17 (tests/fuzz/corpus.py)."""
    session.check(run(case, _CTX()), case)
