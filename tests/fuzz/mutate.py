"""Mutators: byte-level edits of any file, and structured edits of a decoded metadata document.

A mutation is plain data (a list of tuples), so a case can be printed, stored in the corpus
and replayed. ``random_*`` functions draw mutations from a ``random.Random`` (the long run);
:mod:`tests.fuzz.strategies` draws the same shapes with hypothesis (the default suite).
"""

from __future__ import annotations

import copy
import random
import struct
from typing import Any

# -- byte-level ------------------------------------------------------------------------------------

ByteOp = tuple  # ("flip", pos, bit) | ("set", pos, byte) | ("truncate", n) | ("insert", pos, bytes)
#                 | ("delete", pos, n) | ("dup", pos, n)

_INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0xC0, 0xC1, 0xD9, 0xDB, 0xDD, 0xDF, 0xC7, 0xC9)


def apply_bytes(data: bytes, ops: list[ByteOp]) -> bytes:
    """Apply byte edits in order; positions wrap around the current length."""
    buf = bytearray(data)
    for op in ops:
        kind = op[0]
        n = len(buf)
        if kind == "truncate":
            del buf[op[1] % (n + 1):]
        elif kind == "insert":
            pos = op[1] % (n + 1)
            buf[pos:pos] = op[2]
        elif not n:
            continue
        elif kind == "flip":
            buf[op[1] % n] ^= 1 << (op[2] % 8)
        elif kind == "set":
            buf[op[1] % n] = op[2] & 0xFF
        elif kind == "delete":
            pos = op[1] % n
            del buf[pos:pos + op[2]]
        elif kind == "dup":
            pos = op[1] % n
            buf[pos:pos] = buf[pos:pos + op[2]]
        else:
            raise ValueError(f"unknown byte op {kind!r}")
    return bytes(buf)


def random_byte_ops(rng: random.Random, size: int, region: tuple[int, int] | None = None) -> list[ByteOp]:
    """1-3 edits, mostly single bit flips (the commonest real corruption), inside ``region``."""
    lo, hi = region or (0, max(size, 1))
    ops: list[ByteOp] = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        pos = rng.randrange(lo, max(hi, lo + 1))
        r = rng.random()
        if r < 0.55:
            ops.append(("flip", pos, rng.randrange(8)))
        elif r < 0.75:
            ops.append(("set", pos, rng.choice(_INTERESTING_BYTES + (rng.randrange(256),))))
        elif r < 0.83:
            ops.append(("truncate", rng.randrange(size + 1)))
        elif r < 0.90:
            ops.append(("insert", pos, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))))
        elif r < 0.96:
            ops.append(("delete", pos, rng.randrange(1, 9)))
        else:
            ops.append(("dup", pos, rng.randrange(1, 64)))
    return ops


# -- structured (metadata documents) -----------------------------------------------------------------

# The metadata's columnar fields: raw little-endian arrays inside msgpack bytes (struct formats).
COLUMNS = {
    ("tensors", "ndim"): "<i", ("tensors", "shape"): "<q",
    ("boxes", "tensor"): "<i", ("boxes", "offsets"): "<q", ("boxes", "lengths"): "<q",
    ("boxes", "file"): "<i", ("boxes", "byte_offset"): "<q", ("boxes", "byte_length"): "<q",
    ("boxes", "checksums"): "<Q",
}
_INT_LIMITS = {"<i": (-(2**31), 2**31 - 1), "<q": (-(2**63), 2**63 - 1), "<Q": (0, 2**64 - 1)}

HOSTILE_SCALARS: tuple[Any, ...] = (
    None, True, False, 0, 1, -1, 2, 3, 7, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -(2**63),
    2**64 - 1, 0.5, -0.0, float("nan"), float("inf"), float("-inf"), 1e308, 1e20, "", "x", "..",
    "../escape", "/etc/passwd", "a/b", "a\x00b", ".hidden", "model-00000.safetensors", "float32",
    "int32", "float64", "bfloat16", "bool", "uint8", "complex64", "object", "bytecheckpoint", "ddp",
    "x" * 5000, b"", b"\x00" * 16, [], {}, [1, 2], {"a": 1}, [[]], [None],
)


def hostile_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.8 or depth > 2:
        return rng.choice(HOSTILE_SCALARS)
    if r < 0.9:
        return [hostile_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(("a", "key", "", "0")): hostile_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def _walk(doc: Any, path: tuple = ()) -> list[tuple]:
    """Every addressable place in the document: containers, leaves and column elements."""
    places = [path] if path else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            places += _walk(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            places += _walk(v, path + (i,))
    elif isinstance(doc, bytes) and path[-2:] in COLUMNS:
        size = struct.calcsize(COLUMNS[path[-2:]])
        places += [path + (("elem", i),) for i in range(len(doc) // size)]
    return places


def places(doc: Any) -> list[tuple]:
    return _walk(doc)


def _get(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def clamp(fmt: str, value: int) -> int:
    """``value`` brought into the range a column element of ``fmt`` can hold."""
    lo, hi = _INT_LIMITS[fmt]
    return min(max(int(value), lo), hi)


def _column_edit(raw: bytes, fmt: str, index: int, value: int) -> bytes:
    size = struct.calcsize(fmt)
    value = clamp(fmt, value)
    buf = bytearray(raw)
    buf[index * size:(index + 1) * size] = struct.pack(fmt, value)
    return bytes(buf)


DocOp = tuple  # ("set", path, value) | ("drop", path) | ("elem", path, index, int) |
#                ("swap", path, i, j) | ("resize", path, delta) | ("add", path, key, value)


def apply_doc(doc: dict, ops: list[DocOp]) -> dict:
    """A mutated deep copy of ``doc``; ops whose place no longer exists are skipped."""
    doc = copy.deepcopy(doc)
    for op in ops:
        try:
            _apply_one(doc, op)
        except (KeyError, IndexError, TypeError, struct.error):
            continue
    return doc


def _apply_one(doc: dict, op: DocOp) -> None:
    kind, path = op[0], tuple(op[1])
    if kind in ("elem", "swap", "resize"):
        raw, fmt = _get(doc, path), COLUMNS[path[-2:]]
        size = struct.calcsize(fmt)
        count = len(raw) // size
        if kind == "elem":
            new = _column_edit(raw, fmt, op[2] % max(count, 1), op[3]) if count else raw
        elif kind == "swap":
            if not count:
                return
            i, j = op[2] % count, op[3] % count
            items = [raw[k * size:(k + 1) * size] for k in range(count)]
            items[i], items[j] = items[j], items[i]
            new = b"".join(items)
        else:
            new = raw[: max(0, len(raw) + op[2] * size)] if op[2] < 0 else raw + raw[-size:] * op[2]
        _get(doc, path[:-1])[path[-1]] = new
        return
    parent = _get(doc, path[:-1]) if path else None
    if kind == "set":
        parent[path[-1]] = op[2]
    elif kind == "drop":
        del parent[path[-1]]
    elif kind == "add":
        target = _get(doc, path)
        if isinstance(target, dict):
            target[op[2]] = op[3]
        elif isinstance(target, list):
            target.append(op[3])
    else:
        raise ValueError(f"unknown doc op {kind!r}")


def random_doc_ops(rng: random.Random, doc: dict) -> list[DocOp]:
    """One or two edits at random places of ``doc``, biased to the fields load relies on."""
    where = places(doc)
    ops: list[DocOp] = []
    for _ in range(rng.choice((1, 1, 1, 2))):
        place = rng.choice(where)
        r = rng.random()
        if place and isinstance(place[-1], tuple):  # a column element
            col = place[:-1]
            fmt = COLUMNS[col[-2:]]
            index = place[-1][1]
            if r < 0.6:
                old = struct.unpack_from(fmt, _get(doc, col), index * struct.calcsize(fmt))[0]
                value = rng.choice((old + 1, old - 1, old ^ (1 << rng.randrange(63)), old * 2, old // 2,
                                    0, -1, 2**31, 2**62, -(2**62)))
                ops.append(("elem", col, index, clamp(fmt, value)))
            elif r < 0.9:
                ops.append(("swap", col, index, rng.randrange(1 << 16)))
            else:
                ops.append(("resize", col, rng.choice((-1, 1, -2))))
        elif r < 0.75:
            ops.append(("set", place, hostile_value(rng)))
        elif r < 0.9:
            ops.append(("drop", place))
        else:
            ops.append(("add", place[:-1], rng.choice(("extra", "version", "0")), hostile_value(rng)))
    return ops
