"""Resolving a checkpoint path, reading its metadata, and verification.

The commit protocol (staging, commit, overwrite, the ``latest`` pointer) lives in
:mod:`.protocol`; its names are re-exported here for the tools that import them from this module.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from ..errors import (
    ColdTierUnavailableError,
    CorruptCheckpointError,
    NotACheckpointError,
    NotARegularFileError,
    StorageIOError,
)
from ..format.checksums import bad_chunks
from ..format.file_headers import Entry, expected_entries, header_problem, padding_limit
from ..format.metadata import METADATA_FILE, ByteMeta, CheckpointMetadata
from ..format.metadata_file import metadata_max_bytes, read_metadata_bytes
from ..storage import Storage, open_storage
from .protocol import (  # noqa: F401  (re-exported)
    LATEST_FILE,
    REPLACED_TAG,
    STAGING_TAG,
    Latest,
    abandon,
    begin_save,
    commit,
    read_latest,
    repair,
    split_checkpoint_path,
    staging_path,
    stale_staging_dirs,
    update_latest,
)
from .save_lock import local_os_path

_VERIFY_BLOCK = 64 << 20  # bytes of one piece a verify thread holds at a time


def _find(storage: Storage, path: str) -> str | None:
    """The committed checkpoint at ``path`` or named by its ``latest``, or None."""
    if storage.exists(posixpath.join(path, METADATA_FILE)):
        split_checkpoint_path(path)
        return path
    found = repair(storage, path)  # a commit that died part-way through an overwrite
    if found is not None:
        return found
    latest = read_latest(storage, path)
    if latest is None:
        return None
    target = posixpath.join(path, latest.name)
    if storage.exists(posixpath.join(target, METADATA_FILE)):
        return target
    return repair(storage, target)


def dangling_target(local: str | None) -> str | None:
    """Where the local path ``local`` links to, when it is a link (its checkpoint was cooled)
    to nothing; else None."""
    if local is None or not os.path.islink(local) or os.path.exists(local):
        return None
    return os.path.realpath(local)


def dangling_link(storage: Storage, full: str) -> str | None:
    """:func:`dangling_target` of the storage file ``full`` (None off local disk)."""
    return dangling_target(local_os_path(storage, full))


def dangling_metadata_link(storage: Storage, path: str) -> str | None:
    """Where the metadata of the local checkpoint at ``path`` links to, when it is a link to
    nothing; else None."""
    return dangling_link(storage, posixpath.join(path, METADATA_FILE))


def cold_tier_unavailable(url: str, missing: str) -> ColdTierUnavailableError:
    """The error for a cooled checkpoint whose cold copy at ``missing`` is not there: committed
    and intact, not corrupt; its cold tier is not mounted (or was moved)."""
    return ColdTierUnavailableError(
        f"{url} links to {missing}, which is not there: the checkpoint is committed and was cooled to "
        "a cold tier that is not mounted now (or was moved). Mount the cold tier again where the links "
        "point, then load it; nothing was read", missing=missing)


def resolve(url: str) -> tuple[Storage, str]:
    """Find the committed checkpoint at ``url`` (a checkpoint or a root with ``latest``)."""
    storage, path = open_storage(url)
    path = path.rstrip("/") or path
    # An overwrite swapping a checkpoint in hides it for a moment: look twice before saying no.
    for _attempt in range(2):
        found = _find(storage, path)
        if found is not None:
            return storage, found
    from ..interop.dcp_load import open_dcp  # a PyTorch DCP directory, read as it is

    dcp = open_dcp(storage, path)
    if dcp is not None:
        return dcp, path
    latest = read_latest(storage, path)
    if latest is not None:
        missing = dangling_metadata_link(storage, posixpath.join(path, latest.name))
        if missing is not None:
            raise cold_tier_unavailable(f"{url}: the latest pointer names {latest.name!r}, whose "
                                        f"{METADATA_FILE}", missing)
        raise NotACheckpointError(
            f"{url}: the latest pointer names {latest.name!r}, which holds no committed "
            "checkpoint (it was deleted or moved); load a specific checkpoint instead"
        )
    name = posixpath.basename(path)
    if STAGING_TAG in name:
        raise NotACheckpointError(
            f"{url} is the staging directory of a save that never committed; it cannot be "
            "loaded. Load the last committed checkpoint instead"
        )
    try:
        stale = stale_staging_dirs(storage, path)
    except NotACheckpointError:
        stale = []
    if stale:
        raise NotACheckpointError(
            f"{url}: a save to this path was started but never committed (staging: "
            f"{posixpath.basename(stale[0])}); load the previous checkpoint instead"
        )
    missing = dangling_metadata_link(storage, path)
    if missing is not None:
        raise cold_tier_unavailable(f"{url}: its {METADATA_FILE}", missing)
    if storage.is_dir(path):
        raise NotACheckpointError(
            f"{url} is not a checkpoint: it has no {METADATA_FILE} (written when a save commits)"
            " and no 'latest' pointer"
        )
    if storage.exists(path):
        raise NotACheckpointError(f"{url} is a file, not a checkpoint (a directory a save committed)")
    if storage.scheme == "mem":
        raise NotACheckpointError(
            f"{url}: no such checkpoint in this process (mem:// lives in the memory of the process "
            "that saved it: another process, or this one after a restart, sees none of it; use "
            "shm:// to share checkpoints between the processes of a host)")
    raise NotACheckpointError(f"{url}: no such checkpoint")


def read_metadata_identified(storage: Storage, path: str) -> tuple[CheckpointMetadata, bytes]:
    """The metadata and its identity (a digest of its bytes): a load compares the identity
    again when it ends, to notice that the checkpoint was replaced meanwhile."""
    meta_path = posixpath.join(path, METADATA_FILE)
    raw = read_metadata_bytes(storage, meta_path)
    return CheckpointMetadata.from_bytes(raw, source=storage.url(meta_path)), xxhash.xxh3_128_digest(raw)


def metadata_identity(storage: Storage, path: str) -> bytes | None:
    """The identity of the metadata now at ``path``; None where there is none (or it cannot be read)."""
    try:
        return xxhash.xxh3_128_digest(read_metadata_bytes(storage, posixpath.join(path, METADATA_FILE)))
    except (OSError, EOFError, CorruptCheckpointError):
        return None


def read_metadata(storage: Storage, path: str) -> CheckpointMetadata:
    meta_path = posixpath.join(path, METADATA_FILE)
    raw = read_metadata_bytes(storage, meta_path)
    return CheckpointMetadata.from_bytes(raw, source=storage.url(meta_path))


def check_file_sizes(storage: Storage, path: str, meta: CheckpointMetadata, names: set[str], *,
                     headers: bool = False) -> None:
    """Every storage file in ``names`` is there with the size the metadata records, before a
    byte of it is trusted; with ``headers``, its safetensors header lists exactly the pieces
    the metadata places in it (see :mod:`.file_headers`)."""
    expected = expected_entries(meta, names) if headers else {}
    for name in sorted(names):
        problem = file_problem(storage, path, meta, name, expected.get(name, []) if headers else None)
        if problem is not None:
            raise CorruptCheckpointError(problem)


def file_problem(storage: Storage, path: str, meta: CheckpointMetadata, name: str,
                 header: list[Entry] | None) -> str | None:
    """What is wrong with one storage file (missing, wrong size, a header that disagrees with
    ``header``, when given), or None."""
    f = meta.file(name)
    full = posixpath.join(path, name)
    try:
        size = storage.size(full)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        missing = dangling_link(storage, full)
        if missing is not None:  # cooled, its cold tier unmounted: not damaged, unreachable
            raise cold_tier_unavailable(storage.url(full), missing) from None
        return f"{storage.url(full)}: storage file is missing from the checkpoint"
    except NotARegularFileError:  # a FIFO or device in its place: never opened, so never a hang
        return f"{storage.url(full)}: is not a regular file (a FIFO, socket or device took its place)"
    if size != f.size:
        return (f"{storage.url(full)}: storage file is {size} bytes but the metadata records "
                f"{f.size} (truncated or overwritten)")
    if header is None:
        return None
    try:
        return header_problem(storage, path, name, size, header, metadata_max_bytes(),
                              padding=padding_limit(meta.format_version))
    except (OSError, EOFError) as exc:
        if isinstance(exc, StorageIOError) and not isinstance(exc, NotARegularFileError):
            raise  # the storage failed (no descriptors or memory left, EIO), not the file's bytes
        return f"{storage.url(full)}: cannot read its safetensors header: {exc}"


@dataclass(frozen=True)
class Problem:
    """One finding of a verification: the storage file (a plain name in the checkpoint) and what
    is wrong with it."""

    file: str
    message: str


def verify_files(url: str, *, threads: int = 4,
                 progress: Callable[[int], None] | None = None) -> tuple[str, list[Problem]]:
    """Re-check every checksum of a checkpoint in ``threads`` parallel readers.

    Each file's size and safetensors header are checked against the metadata first; a file
    that fails is reported once and its pieces are not read. Pieces are read in blocks of
    whole checksum chunks, so memory stays bounded whatever a piece's size.
    Returns the checkpoint's URL and the problems, each naming its file. ``progress`` is called
    with the byte count of each piece once it is checked (from the worker threads)."""
    storage, path = resolve(url)
    if not getattr(storage, "checksummed", True):
        raise NotACheckpointError(
            f"{url} is a PyTorch DCP checkpoint, which stores no checksums or file headers to "
            "verify; bcp.load reads it as it is (checking sizes and bounds), and a bcp.save of "
            "the loaded state gives a checkpoint that bcp verify can check")
    meta = read_metadata(storage, path)
    expected = expected_entries(meta, {f.name for f in meta.files})
    problems: list[Problem] = []
    for f in meta.files:
        problem = file_problem(storage, path, meta, f.name, expected.get(f.name, []))
        if problem is not None:
            problems.append(Problem(f.name, problem))
    pieces = [sb.bytes for t in meta.tensors for sb in meta.boxes_of(t.key)]
    pieces += [o.bytes for o in meta.objects]
    bad_file = {p.file for p in problems}
    padding_before, holes = _padding_gaps(storage, path, pieces, bad_file,
                                          padding_limit(meta.format_version))
    problems += holes
    block = max(1, _VERIFY_BLOCK // meta.chunk_bytes) * meta.chunk_bytes

    def check(i: int) -> list[Problem]:
        piece = pieces[i]
        full = posixpath.join(path, piece.file)
        if piece.file in bad_file:
            return []  # already reported by name; its ranges may not exist
        # The padding before the piece (if any) is read in the piece's first request: no
        # request of its own per gap, which on an object store is a round trip each.
        lead = piece.byte_offset - padding_before.get(i, piece.byte_offset)
        out = []
        try:
            bad = []
            for start in range(0, piece.byte_length, block):
                at, n = piece.byte_offset + start, min(block, piece.byte_length - start)
                data = memoryview(storage.read(full, at - lead, lead + n))
                if lead and any(bytes(data[:lead])):
                    out.append(Problem(piece.file, f"{storage.url(full)}: bytes {at - lead}..{at} "
                                                   "between two pieces (padding) are not zeros: the "
                                                   "file was altered"))
                bad += bad_chunks(data[lead:], start, list(piece.checksums), meta.chunk_bytes)
                lead = 0
        except (OSError, EOFError) as exc:
            if isinstance(exc, StorageIOError) and not isinstance(exc, NotARegularFileError):
                raise  # the storage failed (as in ``file_problem``), not the file's bytes
            return out + [Problem(piece.file, f"{storage.url(full)}: cannot read bytes "
                                              f"{piece.byte_offset}+{piece.byte_length}: {exc}")]
        finally:
            if progress is not None:
                progress(piece.byte_length)
        if bad:
            out.append(Problem(piece.file, f"{storage.url(full)}: checksum mismatch at bytes "
                                           f"{piece.byte_offset}+{piece.byte_length}"))
        return out

    with ThreadPoolExecutor(threads) as pool:
        problems += [p for found in pool.map(check, range(len(pieces))) for p in found]
    return storage.url(path), problems


def _padding_gaps(storage: Storage, path: str, pieces: list[ByteMeta], skip: set[str],
                  limit: int) -> tuple[dict[int, int], list[Problem]]:
    """The bytes between two pieces of a file (the padding that places them, format 3 on;
    shorter than ``limit``) must be zeros: no checksum covers them, and a tool that reads the
    padding entries reads them. Returns, by index into ``pieces``, where the gap before a
    piece starts (one piece per gap, so each gap is read once), and a problem for each file
    (not in ``skip``) with a gap no padding could be, which is never read: a hostile metadata
    could make it any size."""
    by_file: dict[str, list[tuple[int, int, int]]] = {}
    for i, piece in enumerate(pieces):
        if piece.file not in skip and piece.byte_length:
            end = piece.byte_offset + piece.byte_length
            by_file.setdefault(piece.file, []).append((piece.byte_offset, end, i))
    before: dict[int, int] = {}
    holes = []
    for name, spans in sorted(by_file.items()):
        spans.sort()
        gaps = [(end, start, i) for (_, end, _), (start, _, i) in zip(spans, spans[1:]) if start > end]
        hole = next(((a, b) for a, b, _ in gaps if b - a >= max(limit, 1)), None)
        if hole is not None:
            full = storage.url(posixpath.join(path, name))
            holes.append(Problem(name, f"{full}: bytes {hole[0]}..{hole[1]} between two pieces are longer "
                                       f"than any padding ({max(limit - 1, 0)} bytes at most): the "
                                       "metadata or the file was altered"))
            continue
        before.update((i, a) for a, _, i in gaps)
    return before, holes


def verify(url: str, *, threads: int = 4) -> list[str]:
    """Re-check every checksum of a checkpoint; return a description of each problem."""
    return [p.message for p in verify_files(url, threads=threads)[1]]
