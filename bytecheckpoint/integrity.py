"""The commit protocol, the ``latest`` pointer, resolving a path, and verification.

A checkpoint directory is committed when its metadata file exists under the final path.
On storage with atomic rename, ranks write into a hidden staging directory next to the
final one (``.<name>.staging-<id>``); the coordinator writes the metadata last and renames
the directory into place. A crash at any moment leaves either the old state or the new
one, and a staging directory is never mistaken for a checkpoint.

On object stores (``CommitMode.MARKER``: no rename, but a PUT of one object is atomic) ranks
write straight into the final prefix and the metadata object, written last, is the commit.
An in-progress marker object ``.<name>.staging-<id>`` next to it says a save is under way,
so a crashed save is reported as "never committed" and cleaned up by the next save to the
same path. The ``latest`` pointer is replaced by a single PUT. With ``overwrite=True`` the
old checkpoint at the same path is uncommitted (metadata deleted first) when the save starts.
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .checksums import bad_chunks
from .errors import CheckpointExistsError, CorruptCheckpointError, NotACheckpointError, UnsafeCheckpointError
from .file_headers import Entry, expected_entries, header_problem
from .metadata import METADATA_FILE, ByteMeta, CheckpointMetadata, check_file_name
from .storage import CommitMode, Storage, open_storage

METADATA_MAX_ENV = "BCP_METADATA_MAX_BYTES"
DEFAULT_METADATA_MAX_BYTES = 1 << 30
_METADATA_READ_CHUNK = 64 << 20
_VERIFY_BLOCK = 64 << 20  # bytes of one piece a verify thread holds at a time

LATEST_FILE = "latest"
STAGING_TAG = ".staging-"
REPLACED_TAG = ".replaced-"


def split_checkpoint_path(path: str) -> tuple[str, str]:
    path = path.rstrip("/")
    parent, name = posixpath.split(path)
    if not name or name.startswith("."):
        raise NotACheckpointError(
            f"{path!r} cannot be a checkpoint path: give a directory name such as "
            "'checkpoints/step_100' (names starting with '.' are reserved)"
        )
    return parent, name


def staging_path(path: str, save_id: str) -> str:
    parent, name = split_checkpoint_path(path)
    return posixpath.join(parent, f".{name}{STAGING_TAG}{save_id}")


def stale_staging_dirs(storage: Storage, path: str) -> list[str]:
    parent, name = split_checkpoint_path(path)
    prefix = f".{name}{STAGING_TAG}"
    return [posixpath.join(parent, n) for n in storage.list_dir(parent) if n.startswith(prefix)]


def _uncommit(storage: Storage, path: str) -> None:
    """Delete a checkpoint on an object store, its commit (the metadata) first, so a crash
    part-way never leaves metadata that names deleted files."""
    storage.delete(posixpath.join(path, METADATA_FILE))
    storage.delete(path)


def begin_save(storage: Storage, path: str, overwrite: bool, save_id: str) -> str:
    """Check the target, clear what a crashed save to it left, and return where ranks write."""
    marker = storage.commit_mode is CommitMode.MARKER
    committed = storage.exists(posixpath.join(path, METADATA_FILE)) if marker else storage.exists(path)
    stale = stale_staging_dirs(storage, path)
    if marker and not committed and not stale and storage.list_dir(path):
        committed = True  # files that no save of ours left: never write over them silently
    if committed and not overwrite:
        raise CheckpointExistsError(
            f"{storage.url(path)} already holds a checkpoint; choose a new path or pass overwrite=True"
        )
    if marker and (stale or committed):
        _uncommit(storage, path)
    for leftover in stale:
        storage.delete(leftover)  # left by a crashed save to the same path
    staging = staging_path(path, save_id)
    if not marker:
        storage.makedirs(staging)
        return staging
    storage.write_bytes(staging, json.dumps({"save_id": save_id, "started": time.time()}).encode())
    storage.makedirs(path)
    return path


def abandon(storage: Storage, staging: str, path: str, save_id: str) -> None:
    """Remove what a failed save wrote; a committed checkpoint elsewhere is left alone."""
    if storage.commit_mode is CommitMode.MARKER:
        _uncommit(storage, staging)
        storage.delete(staging_path(path, save_id))
    else:
        storage.delete(staging)


def commit(storage: Storage, staging: str, final: str, overwrite: bool, save_id: str) -> None:
    """Make ``staging`` visible as ``final`` (atomic rename; old copy moved aside first).

    On object stores the metadata the caller wrote into ``final`` already committed it; the
    in-progress marker is removed."""
    if storage.commit_mode is CommitMode.MARKER:
        storage.delete(staging_path(final, save_id))
        return
    parent, name = split_checkpoint_path(final)
    replaced = None
    if storage.exists(final):
        if not overwrite:
            raise CheckpointExistsError(f"{storage.url(final)} already exists; pass overwrite=True")
        replaced = posixpath.join(parent, f".{name}{REPLACED_TAG}{save_id}")
        storage.rename(final, replaced)
    storage.rename(staging, final)
    if replaced is not None:
        storage.delete(replaced)


@dataclass(frozen=True)
class Latest:
    name: str
    step: int | None


def read_latest(storage: Storage, root: str) -> Latest | None:
    pointer = posixpath.join(root, LATEST_FILE)
    try:
        doc = json.loads(bytes(storage.read(pointer)).decode())
        name = check_file_name(doc["checkpoint"], pointer)
        return Latest(name, doc.get("step"))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, UnsafeCheckpointError) as exc:
        raise CorruptCheckpointError(f"{pointer}: unreadable latest pointer ({exc})") from exc


def update_latest(storage: Storage, final: str, step: int | None, save_id: str) -> bool:
    """Point ``<parent>/latest`` at ``final`` unless it already names a later step."""
    parent, name = split_checkpoint_path(final)
    current = read_latest(storage, parent)
    if current is not None and step is not None and current.step is not None and current.step > step:
        return False
    doc = json.dumps({"checkpoint": name, "step": step, "time": time.time()}).encode()
    if storage.commit_mode is CommitMode.MARKER:
        storage.write_bytes(posixpath.join(parent, LATEST_FILE), doc)  # one PUT: atomic
        return True
    tmp = posixpath.join(parent, f".{LATEST_FILE}.tmp-{save_id}")
    storage.write_bytes(tmp, doc)
    storage.rename(tmp, posixpath.join(parent, LATEST_FILE), overwrite=True)
    return True


def resolve(url: str) -> tuple[Storage, str]:
    """Find the committed checkpoint at ``url`` (a checkpoint or a root with ``latest``)."""
    storage, path = open_storage(url)
    path = path.rstrip("/") or path
    if storage.exists(posixpath.join(path, METADATA_FILE)):
        split_checkpoint_path(path)
        return storage, path
    latest = read_latest(storage, path)
    if latest is not None:
        target = posixpath.join(path, latest.name)
        if storage.exists(posixpath.join(target, METADATA_FILE)):
            return storage, target
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
    if storage.is_dir(path):
        raise NotACheckpointError(
            f"{url} is not a checkpoint: it has no {METADATA_FILE} (written when a save commits)"
            " and no 'latest' pointer"
        )
    raise NotACheckpointError(f"{url}: no such checkpoint")


def read_metadata(storage: Storage, path: str) -> CheckpointMetadata:
    meta_path = posixpath.join(path, METADATA_FILE)
    raw = read_metadata_bytes(storage, meta_path)
    return CheckpointMetadata.from_bytes(raw, source=storage.url(meta_path))


def metadata_max_bytes() -> int:
    """``BCP_METADATA_MAX_BYTES``: the largest metadata file a reader accepts (default 1 GiB,
    several times what ten million boxes take)."""
    raw = os.environ.get(METADATA_MAX_ENV, "").strip()
    try:
        value = int(raw) if raw else DEFAULT_METADATA_MAX_BYTES
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{METADATA_MAX_ENV} = {raw!r} is not a positive number of bytes; unset it "
                         f"or raise it (default {DEFAULT_METADATA_MAX_BYTES})")
    return value


def read_metadata_bytes(storage: Storage, meta_path: str) -> bytes:
    """The metadata file's bytes, refused above ``metadata_max_bytes()`` before anything is
    allocated, and read in bounded chunks (a file that changes size meanwhile is an error)."""
    size = storage.size(meta_path)
    limit = metadata_max_bytes()
    if size > limit:
        raise CorruptCheckpointError(
            f"{storage.url(meta_path)}: the metadata file is {size} bytes, over the limit of {limit} "
            f"({METADATA_MAX_ENV}); the checkpoint is damaged or hostile, or raise the limit"
        )
    buf = bytearray(size)
    view = memoryview(buf)
    for start in range(0, size, _METADATA_READ_CHUNK):
        end = min(size, start + _METADATA_READ_CHUNK)
        if storage.read_into(meta_path, start, view[start:end]) != end - start:
            raise CorruptCheckpointError(f"{storage.url(meta_path)}: the metadata file shrank while "
                                         "it was read; retry, or check what else writes there")
    return bytes(buf)


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
        return f"{storage.url(full)}: storage file is missing from the checkpoint"
    if size != f.size:
        return (f"{storage.url(full)}: storage file is {size} bytes but the metadata records "
                f"{f.size} (truncated or overwritten)")
    if header is None:
        return None
    try:
        return header_problem(storage, path, name, size, header, metadata_max_bytes())
    except (OSError, EOFError) as exc:
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
    block = max(1, _VERIFY_BLOCK // meta.chunk_bytes) * meta.chunk_bytes

    def check(piece: ByteMeta) -> Problem | None:
        full = posixpath.join(path, piece.file)
        if piece.file in bad_file:
            return None  # already reported by name; its ranges may not exist
        try:
            bad = []
            for start in range(0, piece.byte_length, block):
                data = storage.read(full, piece.byte_offset + start, min(block, piece.byte_length - start))
                bad += bad_chunks(memoryview(data), start, list(piece.checksums), meta.chunk_bytes)
        except (OSError, EOFError) as exc:
            return Problem(piece.file, f"{storage.url(full)}: cannot read bytes "
                                       f"{piece.byte_offset}+{piece.byte_length}: {exc}")
        finally:
            if progress is not None:
                progress(piece.byte_length)
        if bad:
            return Problem(piece.file, f"{storage.url(full)}: checksum mismatch at bytes "
                                       f"{piece.byte_offset}+{piece.byte_length}")
        return None

    with ThreadPoolExecutor(threads) as pool:
        problems += [p for p in pool.map(check, pieces) if p]
    return storage.url(path), problems


def verify(url: str, *, threads: int = 4) -> list[str]:
    """Re-check every checksum of a checkpoint; return a description of each problem."""
    return [p.message for p in verify_files(url, threads=threads)[1]]
