"""Fuzzing the object codec (the msgpack extra-state blobs) and objects inside a checkpoint.

Supported values must round-trip bit for bit (in this process: they are well-formed). Any
other bytes must decode to some value or raise a named error; those run in the guarded
worker, so a decoder that crashes the interpreter (the 200-level nested extension types of
issue 17) fails the test instead of killing the run.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz import corpus, objects, session
from tests.fuzz.outcomes import NAMED, OK
from tests.fuzz.strategies import byte_ops, fuzz_settings, object_values

pytestmark = pytest.mark.fuzz


@fuzz_settings(150)
@given(object_values)
def test_supported_values_round_trip_bit_for_bit(value):
    session.check(objects.roundtrip_case(value), ["roundtrip", repr(value)[:200]])


@fuzz_settings(100)
@given(st.data())
def test_edited_encodings_decode_or_are_refused_by_name(data):
    blob = objects.codec.encode(data.draw(object_values))
    case = ["object", objects.apply_bytes(blob, data.draw(byte_ops(len(blob))))]
    session.check(session.guard().case(case), case)


@fuzz_settings(60)
@given(st.integers(0, 2**32))
def test_hostile_encodings_decode_or_are_refused_by_name(seed):
    case = ["object", objects.hostile_blob(random.Random(seed))]
    session.check(session.guard().case(case), case)


@pytest.mark.parametrize("depth", [31, 33, 200, 5000])
def test_deeply_nested_extension_types_are_refused_by_name_not_a_crash(depth):
    result = session.guard().case(["object", objects.nested_ext(depth)])
    assert result.kind in (OK, NAMED), result.detail
    if depth > 64:
        assert result.kind == NAMED, "a 200-level nesting is hostile: it must be refused"


@fuzz_settings(25)
@given(st.integers(0, 2**32))
def test_a_hostile_object_inside_a_checkpoint_loads_exactly_or_is_refused(seed):
    """The blob replaces the extra state with matching checksums, so load reaches the decoder."""
    case = ["object_checkpoint", objects.random_blob(random.Random(seed))]
    session.check(session.guard().case(case), case)


@pytest.mark.parametrize("name,case", corpus.load("object"), ids=lambda v: v if isinstance(v, str) else "")
def test_corpus(name, case):
    session.check(session.guard().case(case), case)
