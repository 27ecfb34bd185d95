"""Storage files: valid safetensors files (JSON header, then raw bytes in plan order).

Being safetensors means common tools can open a rank's file; the bytecheckpoint metadata
stores absolute byte offsets, so loads never need to parse these headers. Entries are named
``<key>@<offsets>`` so a box can be recognised in any viewer.

Every piece of at least ``DATA_ALIGN`` bytes starts at a multiple of ``DATA_ALIGN`` from the
file's start (format version 3): the header is padded with spaces, and where a piece of odd
size leaves the next one off the boundary, a padding entry (``__padding__/<n>``, ``U8``, zeros,
fewer than ``DATA_ALIGN`` bytes) fills the gap, since safetensors allows no holes. A read copies
from the page cache into tensors that are 64-byte aligned, and that copy ran at 10.8-12 GB/s
when source and destination shared their offset within a cache line and at 5.5-8 GB/s when
they did not (``bench/copy_alignment.py``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..format.checksums import chunk_checksums
from ..format.file_headers import DATA_ALIGN, PADDING_PREFIX
from ..storage import Storage
from ..storage.base import abort_quietly

# Large pieces are written in blocks so hashing and writing interleave in cache: a block is
# hashed, then copied into the page cache while still in the CPU's caches. 4 ranks writing
# 16 MiB blocks overflow a 32 MiB L3 between the two; with 4 MiB blocks the writes took about
# 20% less system CPU at equal wall time (bench/write_block.py: 1.45 against 1.85 s), CPU an
# overlapped save leaves to training.
_WRITE_BLOCK = 4 << 20


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


def data_layout(sizes: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Where each piece of ``sizes`` starts in the data section, and the padding entries
    (start, length) before the pieces of at least ``DATA_ALIGN`` bytes that would start off
    the boundary. The data section itself starts on one (``header_bytes``)."""
    starts: list[int] = []
    pads: list[tuple[int, int]] = []
    end = 0
    for n in sizes:
        gap = -end % DATA_ALIGN
        if gap and n >= DATA_ALIGN:  # a smaller piece gains nothing from the boundary
            pads.append((end, gap))
            end += gap
        starts.append(end)
        end += n
    return starts, pads


def header_bytes(pieces: list[Piece], metadata: dict[str, str], starts: list[int],
                 pads: list[tuple[int, int]]) -> bytes:
    """The header of a file laid out by ``data_layout``."""
    header: dict[str, object] = {"__metadata__": metadata}
    entries = [(s, p.name, p.code, list(p.shape), p.nbytes) for s, p in zip(starts, pieces)]
    entries += [(s, f"{PADDING_PREFIX}{i}", "U8", [n], n) for i, (s, n) in enumerate(pads)]
    for start, name, code, shape, n in sorted(entries, key=lambda e: e[0]):
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [start, start + n]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    # safetensors pads the header with spaces to 8 bytes; to DATA_ALIGN here, so that the
    # data section starts on the boundary
    raw += b" " * (-(len(raw) + 8) % DATA_ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def write_file(
    storage: Storage, path: str, pieces: list[Piece], chunk_bytes: int, metadata: dict[str, str]
) -> tuple[int, list[WrittenPiece]]:
    """Write ``pieces`` to ``path``; return the file size and where each piece landed."""
    starts, pads = data_layout([p.nbytes for p in pieces])
    head = header_bytes(pieces, metadata, starts, pads)
    writer = storage.open_writer(path)
    written: list[WrittenPiece] = []
    try:
        writer.write(head)
        offset = len(head)
        for p, start in zip(pieces, starts):
            if len(head) + start > offset:  # the padding entry before this piece
                writer.write(bytes(len(head) + start - offset))
                offset = len(head) + start
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
