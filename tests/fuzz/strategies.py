"""Hypothesis strategies for the default-suite fuzz tests, and their settings profiles.

The strategies draw the same plain-data mutations as :mod:`tests.fuzz.mutate` (so a
shrunk failure prints as a replayable case). Two profiles: ``default`` (short: the whole
fuzz suite stays within 60 s on two cores) and ``long`` (``BCP_FUZZ_PROFILE=long``, for a
local soak); both derandomized with no example database, so CI runs are reproducible.
They are registered under ``bcp-fuzz-*`` names so other test files' hypothesis settings are
left alone.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tests.fuzz import cli, mutate, spool

settings.register_profile("bcp-fuzz-default", max_examples=60, deadline=None, derandomize=True,
                          database=None, suppress_health_check=list(HealthCheck))
settings.register_profile("bcp-fuzz-long", max_examples=5000, deadline=None, derandomize=True,
                          database=None, suppress_health_check=list(HealthCheck))
PROFILE = os.environ.get("BCP_FUZZ_PROFILE", "default")
_BASE = settings.get_profile(f"bcp-fuzz-{PROFILE}")


def fuzz_settings(examples: int) -> settings:
    """``examples`` in the default profile; the long profile's count otherwise."""
    return settings(_BASE, max_examples=examples if PROFILE == "default" else _BASE.max_examples)


# -- bytes -------------------------------------------------------------------------------------------

def byte_ops(size: int, lo: int = 0, hi: int | None = None) -> st.SearchStrategy[list]:
    hi = size if hi is None else hi
    pos = st.integers(lo, max(lo, hi - 1))
    op = st.one_of(
        st.tuples(st.just("flip"), pos, st.integers(0, 7)),
        st.tuples(st.just("flip"), pos, st.integers(0, 7)),
        st.tuples(st.just("set"), pos, st.sampled_from(mutate._INTERESTING_BYTES) | st.integers(0, 255)),
        st.tuples(st.just("truncate"), st.integers(0, size)),
        st.tuples(st.just("insert"), pos, st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("delete"), pos, st.integers(1, 8)),
        st.tuples(st.just("dup"), pos, st.integers(1, 64)),
    )
    return st.lists(op, min_size=1, max_size=3)


# -- metadata documents ------------------------------------------------------------------------------

_hostile = st.one_of(
    st.sampled_from(mutate.HOSTILE_SCALARS),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.lists(st.sampled_from(mutate.HOSTILE_SCALARS[:20]), max_size=3),
)


@st.composite
def doc_ops(draw: Any, doc: dict) -> list:
    """One or two edits of ``doc``: a column element (+/-1, a flipped bit, a swap, a resize) or
    a field replaced, dropped or added."""
    places = mutate.places(doc)
    ops = []
    for _ in range(draw(st.integers(1, 2))):
        place = draw(st.sampled_from(places))
        if place and isinstance(place[-1], tuple):
            col, index = place[:-1], place[-1][1]
            fmt = mutate.COLUMNS[col[-2:]]
            old = struct.unpack_from(fmt, mutate._get(doc, col), index * struct.calcsize(fmt))[0]
            kind = draw(st.sampled_from(("elem", "elem", "swap", "resize")))
            if kind == "elem":
                value = draw(st.sampled_from((old + 1, old - 1, old * 2, old // 2, 0, -1, 2**31, 2**62))
                             | st.builds(lambda b, o=old: o ^ (1 << b), st.integers(0, 62)))
                ops.append(("elem", col, index, mutate.clamp(fmt, value)))
            elif kind == "swap":
                ops.append(("swap", col, index, draw(st.integers(0, 1 << 16))))
            else:
                ops.append(("resize", col, draw(st.sampled_from((-1, 1, -2)))))
        else:
            kind = draw(st.sampled_from(("set", "set", "set", "drop", "add")))
            if kind == "set":
                ops.append(("set", place, draw(_hostile)))
            elif kind == "drop":
                ops.append(("drop", place))
            else:
                key = draw(st.sampled_from(("extra", "version", "0")))
                ops.append(("add", place[:-1], key, draw(_hostile)))
    return ops


# -- object values -----------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8, torch.bool)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 9).to(dtype)


_tensors = st.builds(
    _tensor, st.sampled_from(_DTYPES), st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.integers(0, 2**31))
_arrays = st.builds(lambda dt, n: np.arange(n).astype(dt), st.sampled_from(("<i4", ">f8", "u1", "<c8", "?")),
                    st.integers(0, 5))
_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=10),
    st.binary(max_size=10), st.sampled_from((torch.float16, torch.bfloat16, torch.int32)), _tensors, _arrays,
)
object_values = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers(-5, 2**65), st.tuples(st.integers(0, 3))),
                        inner, max_size=4),
    ),
    max_leaves=12,
)

# -- spool lines and command lines -----------------------------------------------------------------

_field_values = st.one_of(st.sampled_from(spool.HOSTILE), st.integers(-(10**30), 10**30),
                          st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))


@st.composite
def spool_lines(draw: Any) -> list[bytes]:
    import random

    lines = []
    for _ in range(draw(st.integers(1, 4))):
        event = spool.good_event(random.Random(draw(st.integers(0, 2**32))))
        kind = draw(st.sampled_from(("field", "field", "bytes", "raw")))
        if kind == "field":
            event[draw(st.sampled_from(spool.FIELDS))] = draw(_field_values)
            lines.append(spool._json(event))
        elif kind == "bytes":
            line = spool._json(event)
            lines.append(mutate.apply_bytes(line, draw(byte_ops(len(line)))).replace(b"\n", b" "))
        else:
            lines.append(draw(st.binary(max_size=60)).replace(b"\n", b" "))
    return lines


@st.composite
def argvs(draw: Any, paths: tuple[str, ...]) -> list[str]:
    command = draw(st.sampled_from(cli.COMMANDS))
    positional = 2 if command in ("export", "import") else 1
    argv = [command] + [draw(st.sampled_from(paths)) for _ in range(positional)]
    if command == "gc":
        argv += ["--keep-last", draw(st.sampled_from(("1", "0", "-1", "2", "abc")))]
    for _ in range(draw(st.integers(0, 3))):
        option = draw(st.sampled_from(cli.OPTIONS[command]))
        argv.append(option)
        if option not in cli._FLAGS:
            values = paths if option == "--cold" else cli.VALUES
            argv.append(draw(st.sampled_from(values)))
    return argv
