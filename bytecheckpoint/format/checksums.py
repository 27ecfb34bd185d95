"""Checksums of stored bytes.

Each stored piece (a tensor box or an object blob) is hashed in fixed-size chunks counted
from the piece's first byte, while it is written. A ranged read that covers only part of a
piece widens itself to chunk boundaries and still verifies every byte it uses, so loads
that reshard are checked as fully as loads that do not.
"""

from __future__ import annotations

import xxhash

CHECKSUM_ALGORITHM = "xxh3_64"
DEFAULT_CHUNK_BYTES = 4 << 20


def chunk_count(length: int, chunk_bytes: int) -> int:
    return max(1, -(-length // chunk_bytes)) if length else 0


def chunk_checksums(data: memoryview, chunk_bytes: int) -> list[int]:
    """Hash ``data`` chunk by chunk (the last chunk may be short)."""
    mv = memoryview(data).cast("B")
    return [
        xxhash.xxh3_64_intdigest(mv[start : start + chunk_bytes])
        for start in range(0, len(mv), chunk_bytes)
    ]


def widen_to_chunks(start: int, end: int, length: int, chunk_bytes: int) -> tuple[int, int]:
    """Widen the byte range ``[start, end)`` of a piece to whole checksum chunks."""
    lo = (start // chunk_bytes) * chunk_bytes
    hi = min(length, -(-end // chunk_bytes) * chunk_bytes)
    return lo, hi


def bad_chunks(
    data: memoryview, first_byte: int, expected: list[int], chunk_bytes: int
) -> list[int]:
    """Indexes of chunks in ``data`` (which starts at chunk boundary ``first_byte``) that
    do not match ``expected`` (the piece's full list of chunk checksums)."""
    first_chunk = first_byte // chunk_bytes
    got = chunk_checksums(data, chunk_bytes)
    return [first_chunk + i for i, h in enumerate(got) if h != expected[first_chunk + i]]
