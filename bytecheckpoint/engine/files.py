"""Storage files: valid safetensors files (JSON header, then raw bytes in plan order).

Being safetensors means common tools can open a rank's file; the bytecheckpoint metadata
stores absolute byte offsets, so loads never need to parse these headers. Entries are named
``<key>@<offsets>`` so a box can be recognised in any viewer.

Every piece of at least ``DATA_ALIGN`` bytes starts at a multiple of ``DATA_ALIGN`` from the
file's start (format version 3): the header is padded with spaces, and where a piece of odd
size leaves the next one off the boundary, a padding entry (``__padding__/<n>``, ``U8``, zeros)
fills the gap, since safetensors allows no holes. A read copies from the page cache into
tensors that are 64-byte aligned, and that copy ran at 10.8-12 GB/s when source and
destination shared their offset within a cache line and at 5.5-8 GB/s when they did not
(``bench/copy_alignment.py``).

Where the writer can write straight from memory (``Writer.direct_alignment``: ``O_DIRECT``,
format version 4), a large piece whose memory address is known starts where that address
lies modulo the direct alignment (512 bytes on most disks; padding of fewer than
``direct_io.MAX_ALIGN`` bytes) and the header is padded to that alignment, so the piece's
aligned middle goes to the disk with no copy into the page cache (``storage.direct_io``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..format.checksums import chunk_checksums
from ..format.file_headers import DATA_ALIGN, PADDING_PREFIX
from ..storage import Storage
from ..storage.base import Writer, abort_quietly
from ..storage.direct_io import MIN_DIRECT_BYTES

# Large pieces are written in blocks so hashing and writing interleave in cache: a block is
# hashed, then copied into the page cache while still in the CPU's caches. 4 ranks writing
# 16 MiB blocks overflow a 32 MiB L3 between the two; with 4 MiB blocks the writes took about
# 20% less system CPU at equal wall time (bench/write_block.py: 1.45 against 1.85 s), CPU an
# overlapped save leaves to training.
_WRITE_BLOCK = 4 << 20
# Written direct, nothing is copied, so nothing gains from cache-sized blocks: larger calls
# give the disk more requests at once and cost fewer system calls.
_DIRECT_BLOCK = 64 << 20


@dataclass(frozen=True)
class Piece:
    """One entry of a storage file; ``source()`` returns its bytes when it is written.

    ``parts``, when given instead, yields the bytes in blocks whose lengths are multiples of
    the checksum chunk (but the last), about the size it is asked for where it can choose: a
    piece another rank streams to this one, which is never held whole in memory (see
    ``host_files``), or one read from a live tensor (``write_through``).

    ``address``: where the bytes will lie in memory, when known before they are produced (a
    tensor or a staged copy), so that the layout can place them for direct writes. Only a hint:
    bytes found elsewhere are written all the same, through the page cache."""

    name: str
    code: str  # safetensors dtype code
    shape: tuple[int, ...]
    nbytes: int
    source: Callable[[], memoryview] | None
    parts: Callable[[int], Iterable[memoryview]] | None = None
    address: int | None = None


@dataclass(frozen=True)
class WrittenPiece:
    byte_offset: int
    byte_length: int
    checksums: tuple[int, ...]


def data_layout(sizes: list[int], homes: list[int | None] | None = None,
                align: int = DATA_ALIGN) -> tuple[list[int], list[tuple[int, int]]]:
    """Where each piece of ``sizes`` starts in the data section, and the padding entries
    (start, length) before the pieces moved off where the previous one ended: a piece with a
    home (its memory address modulo ``align``) starts at that home modulo ``align``; other
    pieces of at least ``DATA_ALIGN`` bytes on a multiple of ``DATA_ALIGN``. The data section
    itself starts on a multiple of ``align`` (``header_bytes``)."""
    starts: list[int] = []
    pads: list[tuple[int, int]] = []
    end = 0
    for n, home in zip(sizes, homes or [None] * len(sizes)):
        if home is not None:
            gap = (home - end) % align
        else:
            gap = -end % DATA_ALIGN if n >= DATA_ALIGN else 0  # a smaller piece gains nothing
        if gap:
            pads.append((end, gap))
            end += gap
        starts.append(end)
        end += n
    return starts, pads


def header_bytes(pieces: list[Piece], metadata: dict[str, str], starts: list[int],
                 pads: list[tuple[int, int]], align: int = DATA_ALIGN) -> bytes:
    """The header of a file laid out by ``data_layout`` with ``align``."""
    header: dict[str, object] = {"__metadata__": metadata}
    entries = [(s, p.name, p.code, list(p.shape), p.nbytes) for s, p in zip(starts, pieces)]
    entries += [(s, f"{PADDING_PREFIX}{i}", "U8", [n], n) for i, (s, n) in enumerate(pads)]
    for start, name, code, shape, n in sorted(entries, key=lambda e: e[0]):
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [start, start + n]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    # safetensors pads the header with spaces to 8 bytes; to ``align`` here, so that the data
    # section starts on the boundary
    raw += b" " * (-(len(raw) + 8) % align)
    return struct.pack("<Q", len(raw)) + raw


def homes(pieces: list[Piece], writer: Writer) -> tuple[list[int | None], int]:
    """Each piece's home for ``data_layout`` (None: no place to keep) and the alignment they
    are homes modulo: the writer's direct alignment where it has one, for pieces large enough
    to be written direct whose address is known and on a ``DATA_ALIGN`` boundary."""
    direct = writer.direct_alignment
    if direct is None:
        return [None] * len(pieces), DATA_ALIGN
    align = max(direct.memory, DATA_ALIGN)
    return [p.address % align if p.address is not None and p.nbytes >= MIN_DIRECT_BYTES
            and p.address % DATA_ALIGN == 0 else None for p in pieces], align


def write_file(
    storage: Storage, path: str, pieces: list[Piece], chunk_bytes: int, metadata: dict[str, str]
) -> tuple[int, list[WrittenPiece]]:
    """Write ``pieces`` to ``path``; return the file size and where each piece landed."""
    writer = storage.open_writer(path)
    written: list[WrittenPiece] = []
    try:
        at, align = homes(pieces, writer)
        starts, pads = data_layout([p.nbytes for p in pieces], at, align)
        head = header_bytes(pieces, metadata, starts, pads, align)
        direct = writer.direct_alignment is not None
        block = transfer_block(chunk_bytes, _DIRECT_BLOCK if direct else _WRITE_BLOCK)
        writer.write(head)
        offset = len(head)
        for p, start in zip(pieces, starts):
            if len(head) + start > offset:  # the padding entry before this piece
                writer.write(bytes(len(head) + start - offset))
                offset = len(head) + start
            sums: list[int] = []
            done = 0
            for part in _blocks(p, block):
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


def _blocks(p: Piece, block: int) -> Iterator[memoryview]:
    if p.parts is not None:
        for part in p.parts(block):
            yield memoryview(part).cast("B")
        return
    assert p.source is not None
    data = memoryview(p.source()).cast("B")
    if len(data) != p.nbytes:
        raise RuntimeError(f"{p.name}: produced {len(data)} bytes, planned {p.nbytes}")
    for start in range(0, len(data), block):
        yield data[start : start + block]


def write_block(chunk_bytes: int) -> int:
    """The block a piece is hashed and written in: whole checksum chunks, so that chunk
    boundaries line up, of about ``_WRITE_BLOCK`` bytes."""
    return transfer_block(chunk_bytes, _WRITE_BLOCK)


def transfer_block(chunk_bytes: int, target: int) -> int:
    """The multiple of ``chunk_bytes`` nearest ``target`` from below (at least one chunk)."""
    return max(chunk_bytes, (target // chunk_bytes) * chunk_bytes)
