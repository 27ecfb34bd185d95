"""Object blobs: the msgpack extra-state values of ``bytecheckpoint.format.codec``.

Three kinds of case: a random supported value must round-trip bit for bit; a mutated
encoding and a hand-built hostile encoding (deep nesting, huge declared sizes, bad dtype
strings) must decode to some value or raise a named error. Hostile encodings can crash a
C decoder, so these cases run behind :mod:`tests.fuzz.guard`.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import msgpack
import numpy as np
import torch

from bytecheckpoint.format import codec
from tests.fuzz.mutate import apply_bytes, random_byte_ops
from tests.fuzz.outcomes import OK, WRONG, Result, classify

# Extension codes of bytecheckpoint.format.codec (the format, so the fuzzer names them itself).
EXT_TUPLE, EXT_TENSOR, EXT_NDARRAY, EXT_INTKEY_DICT, EXT_BIGINT, EXT_DTYPE = 1, 2, 3, 4, 5, 6
_TORCH_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8,
                 torch.bool, torch.float64)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A value of the types the codec supports (what users put in extra state)."""
    r = rng.random()
    if depth > 3 or r < 0.5:
        return rng.choice((
            None, True, False, rng.randrange(-1000, 1000), 2**70 + rng.randrange(9), -(2**65),
            rng.random(), float("inf"), -0.0, "s" * rng.randrange(5), "é✓", b"\x00\xff",
            torch.float16, np.int64(5), np.float32(1.5),
        ))
    if r < 0.6:
        dtype = rng.choice(_TORCH_DTYPES)
        shape = tuple(rng.randrange(4) for _ in range(rng.randrange(3)))
        generator = torch.Generator().manual_seed(rng.randrange(2**31))
        return (torch.randn(shape, generator=generator) * 10).to(dtype)
    if r < 0.68:
        return np.arange(rng.randrange(6), dtype=rng.choice(("<i4", ">f8", "u1", "<c8")))
    if r < 0.78:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if r < 0.86:
        return tuple(random_value(rng, depth + 1) for _ in range(rng.randrange(4)))
    keys = ("a", "b", 1, -2, (1, 2), 2**66)
    return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of decoded values (NaN-safe for tensors and arrays)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_raw(a), _raw(b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _normalise(value: Any) -> Any:
    """What decoding returns for a value (numpy scalars come back as Python numbers)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_normalise(v) for v in value)
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    return value


def roundtrip_case(value: Any) -> Result:
    try:
        back = codec.decode(codec.encode(value))
    except Exception as exc:  # noqa: BLE001
        return classify(exc)
    if not same(_normalise(value), back):
        return Result(WRONG, f"round trip changed the value: {value!r} -> {back!r}"[:500])
    return Result(OK)


def decode_case(blob: bytes) -> Result:
    """Any bytes: a value or a named error, never a raw exception."""
    try:
        codec.decode(blob)
    except Exception as exc:  # noqa: BLE001
        return classify(exc)
    return Result(OK)


# -- hostile encodings ----------------------------------------------------------------------------

def _ext(code: int, payload: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, payload), use_bin_type=True)


def nested_ext(depth: int, code: int = EXT_TUPLE) -> bytes:
    """``depth`` extension types, each holding a one-element list of the next."""
    blob = msgpack.packb(None)
    for _ in range(depth):
        inner = b"\x91" + blob if code in (EXT_TUPLE, EXT_INTKEY_DICT) else blob
        blob = _ext(code, inner)
    return blob


def nested_arrays(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


def hostile_blob(rng: random.Random) -> bytes:
    """One hand-built encoding aimed at a decoder's trust in declared sizes and depths."""
    pack = msgpack.packb
    r = rng.randrange(14)
    if r == 0:
        return nested_ext(rng.choice((50, 200, 1000, 5000)), rng.choice((EXT_TUPLE, EXT_INTKEY_DICT)))
    if r == 1:
        return nested_arrays(rng.choice((100, 1000, 100_000)))
    if r == 2:  # a tensor whose shape promises far more than its bytes
        shape = rng.choice(([2**40], [2**31, 2**31], [-1], [3, -4], [2**63 - 1], ["x"], [1.5], [None]))
        raw = rng.choice((b"", b"\x00" * 4, b"\x00" * 12))
        return _ext(EXT_TENSOR, pack([rng.choice(("float32", "int64", "bool", "nope", "")), shape, raw]))
    if r == 3:
        dtype = rng.choice(("O", "|O", "V8", "<U4", "(100000000,)f8", "S2147483648", "[('a', 'O')]",
                            "datetime64[s]", "<f4", "f", 5, None))
        return _ext(EXT_NDARRAY, pack([dtype, rng.choice(([3], [-1], [2**40], [])), b"\x00" * 12]))
    if r == 4:
        return _ext(EXT_BIGINT, rng.choice((b"9" * 100_000, b"-", b"1e5", b"\xff", b"0x10", b"")))
    if r == 5:
        return _ext(EXT_DTYPE, rng.choice((b"float32", b"object", b"\xff\xfe", b"", b"torch.float32")))
    if r == 6:
        return _ext(EXT_INTKEY_DICT, pack(rng.choice(([[1]], [[[1], 2]], [1, 2], "x", [[{}, 1]]))))
    if r == 7:
        return _ext(rng.choice((0, 7, 100, 127)), b"\x00")
    if r == 8:  # a container declaring 2**32-1 entries with none present
        return rng.choice((b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                           b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01"))
    if r == 9:  # ext tuple whose payload is not a list
        return _ext(EXT_TUPLE, pack(rng.choice((5, "x", None, {"a": 1}))))
    if r == 10:
        return _ext(EXT_TENSOR, pack(rng.choice(([], ["float32"], ["float32", [2]], 5, [1, 2, 3, 4]))))
    if r == 11:  # a map with unhashable keys
        return b"\x81\x91\x01\x02"
    if r == 12:
        value = random_value(rng)
        return apply_bytes(codec.encode(value), random_byte_ops(rng, len(codec.encode(value))))
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))


def random_blob(rng: random.Random) -> bytes:
    """A mutated real encoding half the time, a hostile one otherwise."""
    if rng.random() < 0.5:
        data = codec.encode(random_value(rng))
        return apply_bytes(data, random_byte_ops(rng, len(data)))
    return hostile_blob(rng)
