"""One sequential pass over a file: its whole-file hash and the checkpoint's own checksums.

The metadata holds xxh3-64 checksums of every stored piece (tensor box or object) in 4 MiB
chunks counted from the piece's first byte. Bytes outside pieces (the safetensors header,
the metadata file itself) are covered by the whole-file hash, compared between the hot
original and the cold copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from bytecheckpoint.format.metadata import CheckpointMetadata

BLOCK_BYTES = 16 << 20


@dataclass(frozen=True, order=True)
class ChunkCheck:
    start: int
    end: int
    expected: int = field(compare=False)
    label: str = field(compare=False)


@dataclass(frozen=True)
class FileDigest:
    size: int
    xxh3: int
    bad: tuple[str, ...]  # labels of chunks whose checksum did not match


def chunk_checks(meta: CheckpointMetadata, file_name: str) -> list[ChunkCheck]:
    """Every checksummed chunk stored in ``file_name``, in byte order."""
    pieces = [(sb.key, sb.bytes) for t in meta.tensors for sb in meta.boxes_of(t.key)
              if sb.bytes.file == file_name]
    pieces += [(o.key, o.bytes) for o in meta.objects if o.bytes.file == file_name]
    cb = meta.chunk_bytes
    checks = []
    for key, b in pieces:
        for j, expected in enumerate(b.checksums):
            lo = b.byte_offset + j * cb
            hi = b.byte_offset + min((j + 1) * cb, b.byte_length)
            checks.append(ChunkCheck(lo, hi, expected, f"{key} chunk {j}"))
    return sorted(checks)


def digest(read: Callable[[int, int], bytes | bytearray], size: int, checks: list[ChunkCheck],
           sink: Callable[[bytes | bytearray], None] | None = None) -> FileDigest:
    """Read ``size`` bytes through ``read(offset, length)`` in blocks, hashing the whole file
    and checking each chunk; each block also goes to ``sink`` (the copy's writer)."""
    hasher = xxhash.xxh3_64()
    bad: list[str] = []
    open_chunk = None  # streaming hash of a chunk that spans blocks (same value as one-shot)
    pos = i = 0
    while pos < size:
        block = read(pos, min(BLOCK_BYTES, size - pos))
        if not block:
            break
        hasher.update(block)
        if sink is not None:
            sink(block)
        view, end = memoryview(block), pos + len(block)
        while i < len(checks) and checks[i].start < end:
            c = checks[i]
            if open_chunk is None:
                open_chunk = xxhash.xxh3_64()
            open_chunk.update(view[max(c.start, pos) - pos : min(c.end, end) - pos])
            if c.end > end:
                break
            if open_chunk.intdigest() != c.expected:
                bad.append(c.label)
            open_chunk, i = None, i + 1
        pos = end
    bad += [c.label for c in checks[i:]]  # chunks past the end of a short file
    return FileDigest(pos, hasher.intdigest(), tuple(bad))
