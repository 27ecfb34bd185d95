"""Storage files: valid safetensors files (JSON header, then raw bytes in plan order).

Being safetensors means common tools can open a rank's file; the bytecheckpoint metadata
stores absolute byte offsets, so loads never need to parse these headers. Entries are named
``<key>@<offsets>`` so a box can be recognised in any viewer.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..format.checksums import chunk_checksums
from ..storage import Storage
from ..storage.base import abort_quietly

# Large pieces are written in blocks so hashing and writing interleave in cache.
_WRITE_BLOCK = 16 << 20


@dataclass(frozen=True)
class Piece:
    """One entry of a storage file; ``source()`` returns its bytes when it is written.

    ``parts``, when given instead, yields the bytes in blocks whose lengths are multiples of
    the checksum chunk (but the last): a piece another rank streams to this one, which is
    never held whole in memory (see ``host_files``)."""

    name: str
    code: str  # safetensors dtype code
    shape: tuple[int, ...]
    nbytes: int
    source: Callable[[], memoryview] | None
    parts: Callable[[], Iterable[memoryview]] | None = None


@dataclass(frozen=True)
class WrittenPiece:
    byte_offset: int
    byte_length: int
    checksums: tuple[int, ...]


def header_bytes(pieces: list[Piece], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    start = 0
    for p in pieces:
        header[p.name] = {"dtype": p.code, "shape": list(p.shape), "data_offsets": [start, start + p.nbytes]}
        start += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw)) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def write_file(
    storage: Storage, path: str, pieces: list[Piece], chunk_bytes: int, metadata: dict[str, str]
) -> tuple[int, list[WrittenPiece]]:
    """Write ``pieces`` to ``path``; return the file size and where each piece landed."""
    head = header_bytes(pieces, metadata)
    writer = storage.open_writer(path)
    written: list[WrittenPiece] = []
    try:
        writer.write(head)
        offset = len(head)
        for p in pieces:
            sums: list[int] = []
            done = 0
            for part in _blocks(p, chunk_bytes):
                if done % chunk_bytes:  # a short block that was not the last one
                    raise RuntimeError(f"{p.name}: a block of {len(part)} bytes breaks the checksum chunks")
                sums.extend(chunk_checksums(part, chunk_bytes))
                writer.write(part)
                done += len(part)
            if done != p.nbytes:
                raise RuntimeError(f"{p.name}: produced {done} bytes, planned {p.nbytes}")
            written.append(WrittenPiece(offset, p.nbytes, tuple(sums)))
            offset += p.nbytes
    except BaseException:
        abort_quietly(writer)  # a failing abort must not hide why the write failed
        raise
    size = writer.commit()
    return size, written


def _blocks(p: Piece, chunk_bytes: int) -> Iterator[memoryview]:
    if p.parts is not None:
        for part in p.parts():
            yield memoryview(part).cast("B")
        return
    assert p.source is not None
    data = memoryview(p.source()).cast("B")
    if len(data) != p.nbytes:
        raise RuntimeError(f"{p.name}: produced {len(data)} bytes, planned {p.nbytes}")
    block = write_block(chunk_bytes)
    for start in range(0, len(data), block):
        yield data[start : start + block]


def write_block(chunk_bytes: int) -> int:
    """The block a piece is hashed and written in: whole checksum chunks, so that chunk
    boundaries line up, of about ``_WRITE_BLOCK`` bytes."""
    return transfer_block(chunk_bytes, _WRITE_BLOCK)


def transfer_block(chunk_bytes: int, target: int) -> int:
    """The multiple of ``chunk_bytes`` nearest ``target`` from below (at least one chunk)."""
    return max(chunk_bytes, (target // chunk_bytes) * chunk_bytes)
