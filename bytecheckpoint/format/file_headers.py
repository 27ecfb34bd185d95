"""The safetensors header of a storage file, checked entry by entry against the metadata.

Loads find bytes through the metadata's absolute offsets and never need these headers, but
other tools (safetensors, Hugging Face) read the files through them: a header edited to say
I32 where F32 was written would hand those tools wrong numbers while every checksum of the
data still matches. So ``bcp verify``, export and loads that verify compare each header with
what the metadata says the file holds: the same pieces at the same byte ranges, with the same
dtype code and shape, and nothing else. From format version 3 a header may also list padding
entries (``U8`` zeros in gaps between the pieces: fewer than ``DATA_ALIGN`` bytes in version 3,
which align the pieces for the copies of a load; fewer than ``DIRECT_PADDING`` from version 4,
which also place large pieces for direct writes; see ``engine.files``).
"""

from __future__ import annotations

import json
import posixpath
import struct
from collections import defaultdict
from typing import Any

import numpy as np

from ..storage import Storage
from .dtypes import safetensors_code
from .metadata import CheckpointMetadata

DATA_ALIGN = 64  # pieces start at multiples of this from the file's start (version 3)
PADDING_PREFIX = "__padding__/"
PADDING_SINCE = 3  # the format version that introduced padding entries
DIRECT_PADDING = 4096  # padding entries are shorter than this from version 4 (storage.direct_io)


def padding_limit(version: int) -> int:
    """Padding entries in a storage file of format ``version`` are shorter than this (0: the
    version has none)."""
    if version < PADDING_SINCE:
        return 0
    return DATA_ALIGN if version == PADDING_SINCE else DIRECT_PADDING

# absolute start, end, dtype code, shape, entry name(s). The name matters to the tools that read
# the file by it: two same-shaped entries with swapped names hand them each other's numbers. A
# box is "<key>@<offsets>"; an object "__object__/shared:<key>", or for a per-rank one
# "__object__/rank:<key>" or, in a file several ranks share, "__object__/rank<r>:<key>". Expected
# entries carry every name allowed, read ones the name found.
Entry = tuple[int, int, str, tuple[int, ...], tuple[str, ...]]


def expected_entries(meta: CheckpointMetadata, names: set[str]) -> dict[str, list[Entry]]:
    """What the header of each file in ``names`` must list (as the writers write it: a box's
    shape is its lengths, an object is ``U8`` of its length)."""
    out: dict[str, list[Entry]] = defaultdict(list)
    index = {f.name: i for i, f in enumerate(meta.files)}
    wanted = np.array(sorted(index[n] for n in names if n in index), dtype=np.int32)
    b = meta.boxes
    rows = np.flatnonzero(np.isin(b.file, wanted)).tolist()
    codes = [safetensors_code(t.dtype) for t in meta.tensors]
    ndims = [len(t.shape) for t in meta.tensors]
    for r in rows:
        t, s = int(b.tensor[r]), int(b.dim_start[r])
        start = int(b.byte_offset[r])
        offsets = b.offsets[s : s + ndims[t]].tolist()
        out[meta.files[int(b.file[r])].name].append(
            (start, start + int(b.byte_length[r]), codes[t], tuple(b.lengths[s : s + ndims[t]].tolist()),
             (f"{meta.tensors[t].key}@{','.join(map(str, offsets))}",)))
    for o in meta.objects:
        if o.bytes.file in names:
            start = o.bytes.byte_offset
            scopes = ("shared",) if o.rank is None else ("rank", f"rank{o.rank}")
            out[o.bytes.file].append((start, start + o.bytes.byte_length, "U8", (o.bytes.byte_length,),
                                      tuple(f"__object__/{scope}:{o.key}" for scope in scopes)))
    return out


def header_problem(storage: Storage, path: str, name: str, size: int, expected: list[Entry],
                   max_header: int, padding: int = DIRECT_PADDING) -> str | None:
    """Why the header of ``path/name`` (``size`` bytes, already checked) disagrees with
    ``expected``, or None when it lists exactly those entries (and padding entries shorter
    than ``padding`` bytes in the gaps between them; 0: none allowed, ``padding_limit``)."""
    full = posixpath.join(path, name)
    url = storage.url(full)
    if size < 8:
        return f"{url}: too short for a safetensors header ({size} bytes)"
    (n,) = struct.unpack("<Q", bytes(storage.read(full, 0, 8)))
    if n > min(size - 8, max_header):
        return f"{url}: its safetensors header claims {n} bytes, more than the file or the limit holds"
    try:
        header = json.loads(bytes(storage.read(full, 8, n)))
        got = sorted(_entries(header, 8 + n))
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        return f"{url}: unreadable safetensors header ({exc})"
    want = sorted(expected)
    if padding:
        pads = [g for g in got if g[4][0].startswith(PADDING_PREFIX)]
        got = [g for g in got if not g[4][0].startswith(PADDING_PREFIX)]
        problem = _padding_problem(pads, want, padding)
        if problem is not None:
            return f"{url}: {problem} (the header was altered)"
    if len(got) != len(want):
        return f"{url}: its safetensors header lists {len(got)} entries, the metadata {len(want)}"
    for g, w in zip(got, want):
        if g[:4] != w[:4]:
            return (f"{url}: its safetensors header says bytes {g[0]}..{g[1]} hold {g[2]} {list(g[3])}, the "
                    f"metadata {w[2]} {list(w[3])} at {w[0]}..{w[1]} (the header was altered)")
    names = defaultdict(list)  # entries alike but for the name (empty ones) may come in any order
    for w in want:
        names[w[:4]].append(w[4])
    for g in got:
        match = next((i for i, n in enumerate(names[g[:4]]) if g[4][0] in n), None)
        if match is None:
            return (f"{url}: its safetensors header names bytes {g[0]}..{g[1]} {g[4][0]!r}, the metadata "
                    f"{names[g[:4]][0][0]!r} (the header was altered)")
        names[g[:4]].pop(match)
    return None



def _padding_problem(pads: list[Entry], want: list[Entry], limit: int) -> str | None:
    """A padding entry is U8 zeros of 1 to ``limit - 1`` bytes that overlaps no piece (the
    zeros themselves are not read: they are no piece's bytes), named by its place among the
    file's padding entries (``__padding__/0`` first), as the writer names them: a renamed
    one reads the same bytes, but its header was altered all the same."""
    for i, (start, _end, _code, _shape, names) in enumerate(pads):
        if names[0] != f"{PADDING_PREFIX}{i}":
            return (f"its padding entry at byte {start} is named {names[0]!r}, not "
                    f"'{PADDING_PREFIX}{i}' (padding entries are numbered in file order)")
    for start, end, code, shape, names in pads:
        if code != "U8" or shape != (end - start,) or not 0 < end - start < limit:
            return (f"its padding entry {names[0]!r} is {code} {list(shape)} at {start}..{end}, "
                    f"not U8 of 1-{limit - 1} bytes")
    spans = sorted([(s, e) for s, e, *_ in want if e > s] + [(s, e) for s, e, *_ in pads])
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            return f"a padding entry overlaps a piece at byte {start}"
    return None


def _entries(header: Any, data_start: int) -> list[Entry]:
    if type(header) is not dict:
        raise TypeError("the header is not a JSON object")
    out = []
    for key, value in header.items():
        if key == "__metadata__":
            continue
        dtype, shape, (start, end) = value["dtype"], value["shape"], value["data_offsets"]
        if type(dtype) is not str or type(shape) is not list or not all(type(d) is int for d in shape) \
                or type(start) is not int or type(end) is not int:
            raise TypeError(f"entry {key!r} is malformed")
        out.append((data_start + start, data_start + end, dtype, tuple(shape), (key,)))
    return out
