"""A DCP checkpoint directory seen as a bytecheckpoint checkpoint, so ``bcp.load`` reads it as is.

:func:`open_dcp` wraps the directory's storage in :class:`DcpStorage`, which translates DCP's
``.metadata`` (read by :mod:`.dcp_metadata`, never unpickled normally) into the library's own
metadata and serves it as a virtual ``metadata.msgpack``. The load then runs unchanged: the
metadata goes through the library's validation (boxes inside tensors and files, tiling, no
shared bytes), every needed byte is read once with ranged reads, exchanged and resharded.

What the translation does:
- Each tensor chunk is a ``torch.save`` blob; :func:`.torch_zip.locate_tensor` finds its raw
  bytes inside the blob, which become the box's byte range (DCP files are exposed under
  ``dcp<name>``: DCP's ``__0_0.distcp`` does not start like a plain bytecheckpoint file name).
- Keys follow DCP's state-dict paths (``planner_data``): ``model.<fqn>`` becomes
  ``model/<fqn>``; optimizer state from ``get_state_dict`` (``optim.state.<fqn>.<name>`` and
  ``optim.param_groups.<i>.<hparam>``, or the flattened ``state.<fqn>.<name>`` /
  ``param_groups.<fqn>.<hparam>``) becomes ``optim/state/<fqn>/<name>`` and one
  ``optim/param_groups/<fqn>`` dict per parameter, as bytecheckpoint names them. Top-level
  tensors (a model-only state dict, as torchtitan's last step) become ``model/<fqn>``.
- Non-tensor entries (``BytesStorageMetadata``, pickled values) are decoded with the restricted
  unpickler when they are plain values and re-encoded with the library's codec into a virtual
  objects file; the others are skipped and named in the metadata's ``layout["skipped"]``.
- DCP stores no checksums: a load of a DCP directory checks sizes and bounds, not bytes.
"""

from __future__ import annotations

import itertools
import logging
import posixpath
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from ..errors import CheckpointError, CorruptCheckpointError, PermanentStorageError
from ..format import codec
from ..format.checksums import chunk_checksums
from ..format.metadata import (
    METADATA_FILE,
    BoxTable,
    ByteMeta,
    CheckpointMetadata,
    FileMeta,
    ObjectMeta,
    TensorMeta,
)
from ..format.metadata_file import read_metadata_bytes
from ..storage import Storage, Writer
from ..storage.wrapper import StorageWrapper
from .dcp_metadata import DCP_METADATA_FILE, DcpMetadata, DcpTensor, parse_dcp_metadata
from .safe_pickle import UnsafePickleError
from .torch_zip import BlobEnds, TorchBlobError, locate_tensor, read_plain_value

log = logging.getLogger("bytecheckpoint.interop")

OBJECTS_FILE = "dcp-objects.bin"
FILE_PREFIX = "dcp"
CHUNK_BYTES = 1 << 40  # one placeholder checksum per box: DCP has none (never checked)
_RANK = re.compile(r"^__(\d+)_")
_LOCATE_THREADS = 8
# Blobs whose ends are read together (BlobEnds): at most three 4 KiB blocks each are held.
_LOCATE_BATCH = 512
MAX_OBJECT_BYTES = 64 << 20


def is_dcp_dir(storage: Storage, path: str) -> bool:
    """A directory with DCP's ``.metadata`` and no bytecheckpoint metadata."""
    return (storage.exists(posixpath.join(path, DCP_METADATA_FILE))
            and not storage.exists(posixpath.join(path, METADATA_FILE)))


def open_dcp(storage: Storage, path: str) -> DcpStorage | None:
    """``storage`` seen as a bytecheckpoint checkpoint at ``path`` when ``path`` is a DCP directory."""
    return DcpStorage(storage, path) if is_dcp_dir(storage, path) else None


class DcpStorage(StorageWrapper):
    """Read-only view of a DCP directory with a virtual ``metadata.msgpack`` and objects file."""

    checksummed = False  # loads skip checksum verification: DCP stores none

    def __init__(self, inner: Storage, path: str) -> None:
        super().__init__(inner)
        self.root = path
        self._digest = b""
        self.meta_bytes = b""
        self.objects = b""
        self.aliases: dict[str, str] = {}
        self.skipped: list[str] = []
        self.meta: CheckpointMetadata | None = None
        self._refresh()

    def _refresh(self) -> None:
        raw = read_metadata_bytes(self.inner, posixpath.join(self.root, DCP_METADATA_FILE))
        digest = xxhash.xxh3_128_digest(raw)
        if digest == self._digest:
            return
        source = self.inner.url(posixpath.join(self.root, DCP_METADATA_FILE))
        dcp = parse_dcp_metadata(raw, source=source)
        meta, objects, aliases, skipped = translate(self.inner, self.root, dcp, source=source)
        self.meta, self.objects, self.aliases, self.skipped = meta, objects, aliases, skipped
        self.meta_bytes, self._digest = meta.to_bytes(), digest
        if skipped:
            log.warning("%s: DCP entries skipped (not plain values): %s", source, ", ".join(skipped[:20]))

    # -- the view ------------------------------------------------------------------------
    def _virtual(self, path: str) -> bytes | None:
        if posixpath.dirname(path) != self.root:
            return None
        name = posixpath.basename(path)
        if name == METADATA_FILE:
            self._refresh()  # a DCP save replacing the directory shows as a new metadata
            return self.meta_bytes
        if name == OBJECTS_FILE and self.objects:
            return self.objects
        return None

    def _real(self, path: str) -> str:
        if posixpath.dirname(path) == self.root and posixpath.basename(path) in self.aliases:
            return posixpath.join(self.root, self.aliases[posixpath.basename(path)])
        return path

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        data = self._virtual(path)
        if data is None:
            return self.inner.read_into(self._real(path), offset, buffer)
        view = memoryview(buffer).cast("B")
        piece = data[offset : offset + len(view)]
        view[: len(piece)] = piece
        return len(piece)

    def read_into_many(self, path: str, offset: int, buffers: list[memoryview]) -> int:
        if self._virtual(path) is not None:
            return Storage.read_into_many(self, path, offset, buffers)  # piece by piece, from memory
        return self.inner.read_into_many(self._real(path), offset, buffers)

    def size(self, path: str) -> int:
        data = self._virtual(path)
        return len(data) if data is not None else self.inner.size(self._real(path))

    def exists(self, path: str) -> bool:
        return self._virtual(path) is not None or self.inner.exists(self._real(path))

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise PermanentStorageError(
            f"{self.url(self.root)} is a DCP checkpoint, which bytecheckpoint reads but never "
            "changes; convert it (bcp convert --from dcp SRC DST) to manage it with bcp")

    def open_writer(self, path: str) -> Writer:
        return self._read_only()

    rename = delete = makedirs = _read_only  # type: ignore[assignment]


# -- translation -------------------------------------------------------------------------------

class _Objects:
    """Decoded values, packed with the library's codec into the virtual objects file."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.entries: list[ObjectMeta] = []

    def add(self, key: str, rank: int | None, value: Any) -> None:
        data = codec.encode(value)
        sums = tuple(chunk_checksums(memoryview(data), CHUNK_BYTES))
        self.entries.append(ObjectMeta(key, rank, ByteMeta(OBJECTS_FILE, self.size, len(data), sums)))
        self.parts.append(data)
        self.size += len(data)


def _path_of(dcp: DcpMetadata, fqn: str) -> tuple[str | int, ...]:
    path = dcp.paths.get(fqn)
    if path is not None:
        return path
    return tuple(fqn.split(".", 1)) if "." in fqn else (fqn,)


def _plain_key(parts: tuple[str | int, ...]) -> str | None:
    """Components joined with dots; None when one holds a '/' (the library's separator)."""
    text = [str(p) for p in parts]
    return None if any("/" in p or not p for p in text) else ".".join(text)


def translate(storage: Storage, root: str, dcp: DcpMetadata, *, source: str
              ) -> tuple[CheckpointMetadata, bytes, dict[str, str], list[str]]:
    """The library's metadata for a DCP directory, the virtual objects file, the file aliases
    (alias -> DCP name) and the names of entries left out (with why)."""
    skipped: list[str] = []
    files = sorted(dcp.files)
    aliases = {FILE_PREFIX + name: name for name in files}
    sizes = _file_sizes(storage, root, files, source)
    for where, file, off, length in [(f"chunk {c.offsets} of {t.fqn!r}", c.file, c.offset, c.length)
                                     for t in dcp.tensors.values() for c in t.chunks] + [
            (repr(b.fqn), b.file, b.offset, b.length) for b in dcp.objects.values()]:
        if off + length > sizes[file]:
            raise CorruptCheckpointError(
                f"{source}: {where} is stored at bytes {off}+{length}, outside {file} of "
                f"{sizes[file]} bytes; the checkpoint is truncated, damaged or hostile")
    ranks = [int(m.group(1)) for m in map(_RANK.match, files) if m]
    world_size = min(1 << 24, max(ranks, default=0) + 1)

    # Tensors: each chunk's raw bytes inside its torch.save blob, located in parallel.
    optim_tops = _optimizer_tops(dcp)
    tensors: list[tuple[str, DcpTensor]] = []
    for fqn, t in dcp.tensors.items():
        path = _path_of(dcp, fqn)
        key = _tensor_key(path, optim_tops)
        if key is None:
            skipped.append(f"{fqn} (a name bytecheckpoint cannot key)")
            continue
        tensors.append((key, t))
    if len({k for k, _ in tensors}) != len(tensors):
        raise CheckpointError(f"{source}: two DCP entries map to one bytecheckpoint key; the "
                              "checkpoint's state-dict paths are ambiguous")
    jobs = [(c, t) for _, t in tensors for c in t.chunks]

    def locate(c: Any, t: DcpTensor, ends: BlobEnds) -> tuple[int, int]:
        where = f"{source}: chunk {c.offsets} of {t.fqn!r} ({c.file} at {c.offset})"
        loc = locate_tensor(storage, posixpath.join(root, c.file), c.offset, c.length, source=where,
                            ends=ends)
        if loc.dtype != t.dtype or loc.shape != c.sizes:
            raise TorchBlobError(f"{where}: the blob holds a {loc.dtype} tensor of shape {loc.shape}, "
                                 f"the metadata declares {t.dtype} {c.sizes}")
        if loc.offset + loc.length > c.offset + c.length:
            raise TorchBlobError(f"{where}: the tensor's bytes run past its blob")
        return loc.offset, loc.length

    def locate_batch(batch: list[int]) -> list[tuple[int, int]]:
        # The batch's blobs (one file's, in file order) have their ends read together first.
        first = jobs[batch[0]][0]
        ends = BlobEnds(storage, posixpath.join(root, first.file),
                        [(jobs[j][0].offset, jobs[j][0].length) for j in batch])
        return [locate(*jobs[j], ends) for j in batch]

    in_file_order = sorted(range(len(jobs)), key=lambda j: (jobs[j][0].file, jobs[j][0].offset))
    batches = [same[i : i + _LOCATE_BATCH]
               for _, group in itertools.groupby(in_file_order, key=lambda j: jobs[j][0].file)
               for same in [list(group)] for i in range(0, len(same), _LOCATE_BATCH)]
    found: dict[int, tuple[int, int]] = {}
    with ThreadPoolExecutor(_LOCATE_THREADS) as pool:
        for batch, places in zip(batches, pool.map(locate_batch, batches)):
            found.update(zip(batch, places))

    file_index = {FILE_PREFIX + name: i for i, name in enumerate(files)}
    tmeta: list[TensorMeta] = []
    cols: dict[str, list[int]] = {k: [] for k in ("tensor", "offsets", "lengths", "file", "off", "len")}
    order = sorted(range(len(tensors)), key=lambda i: tensors[i][0])
    by_index = {id(t): i for i, (_, t) in enumerate(tensors)}
    placed: dict[int, list[tuple[Any, tuple[int, int]]]] = {i: [] for i in range(len(tensors))}
    for j, (c, t) in enumerate(jobs):
        placed[by_index[id(t)]].append((c, found[j]))
    for new, i in enumerate(order):
        key, t = tensors[i]
        tmeta.append(TensorMeta(key, t.dtype, t.shape))
        for c, (off, length) in placed[i]:
            cols["tensor"].append(new)
            cols["offsets"].extend(c.offsets)
            cols["lengths"].extend(c.sizes)
            cols["file"].append(file_index[FILE_PREFIX + c.file])
            cols["off"].append(off)
            cols["len"].append(length)
    n = len(cols["tensor"])
    i64 = np.int64
    byte_length = np.array(cols["len"], dtype=i64)
    n_chunks = np.where(byte_length > 0, 1, 0)
    table = BoxTable(
        np.array(cols["tensor"], dtype=np.int32), np.array(cols["offsets"], dtype=i64),
        np.array(cols["lengths"], dtype=i64), np.zeros(n, dtype=i64),  # dim_start: rebuilt on decode
        np.array(cols["file"], dtype=np.int32), np.array(cols["off"], dtype=i64), byte_length,
        np.zeros(n, dtype=i64), np.zeros(int(n_chunks.sum()), dtype=np.uint64))

    objects = _translate_objects(storage, root, dcp, world_size, {k for k, _ in tensors}, skipped, source)
    file_metas = [FileMeta(FILE_PREFIX + name, sizes[name],
                           min(world_size - 1, int(m.group(1))) if (m := _RANK.match(name)) else 0, "dcp")
                  for name in files]
    if objects.size:
        file_metas.append(FileMeta(OBJECTS_FILE, objects.size, 0, "extra"))
    meta = CheckpointMetadata(
        framework="dcp", world_size=world_size, tensors=tmeta, boxes=table, objects=objects.entries,
        files=file_metas, chunk_bytes=CHUNK_BYTES,
        layout={"source": "dcp", "dcp_version": dcp.version, "skipped": skipped},
        created_at=0.0,  # the same bytes on every rank: the ranks compare their metadata digests
    )
    return meta, b"".join(objects.parts), aliases, skipped


def _file_sizes(storage: Storage, root: str, files: list[str], source: str) -> dict[str, int]:
    sizes = {}
    for name in files:
        try:
            sizes[name] = storage.size(posixpath.join(root, name))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise CorruptCheckpointError(f"{source}: names storage file {name}, which is missing from "
                                         "the checkpoint directory") from None
    return sizes


def _optimizer_tops(dcp: DcpMetadata) -> set[str]:
    """The top-level groups that are optimizer state dicts: those with ``param_groups``
    entries (plain values: hyperparameters), nested or flattened. Only there do ``state.*``
    keys name optimizer state; a model may have a submodule named ``state``."""
    tops = set()
    for fqn in dcp.objects:
        path = _path_of(dcp, fqn)
        if len(path) >= 2 and type(path[0]) is str and type(path[1]) is str and (
                path[1] == "param_groups" or path[1].startswith("param_groups.")):
            tops.add(path[0])
    return tops


def _tensor_key(path: tuple[str | int, ...], optim_tops: set[str]) -> str | None:
    if len(path) == 1:  # a bare model state dict (torchtitan's model-only last step)
        rest = _plain_key(path)
        return None if rest is None else f"model/{rest}"
    top, rest = path[0], path[1:]
    if type(top) is not str or "/" in top:
        return None
    optimizer = top in optim_tops
    if optimizer and len(rest) == 3 and rest[0] == "state":  # get_state_dict's nested optimizer state
        fqn, name = _plain_key(rest[1:2]), _plain_key(rest[2:3])
        return None if fqn is None or name is None else f"{top}/state/{fqn}/{name}"
    flat = len(rest) == 1 and isinstance(rest[0], str)
    if optimizer and flat and rest[0].startswith("state.") and rest[0].count(".") >= 2:
        fqn, _, name = rest[0][len("state."):].rpartition(".")  # flatten_optimizer_state_dict
        return None if "/" in rest[0] else f"{top}/state/{fqn}/{name}"
    joined = _plain_key(rest)
    return None if joined is None else f"{top}/{joined}"


def _translate_objects(storage: Storage, root: str, dcp: DcpMetadata, world_size: int,
                       tensor_keys: set[str], skipped: list[str], source: str) -> _Objects:
    """Plain values into library objects: optimizer hyperparameters per parameter FQN, module
    extra values next to their tensors (saved once), anything else rebuilt per top-level key
    and stored for every rank (bytecheckpoint keeps such state per rank)."""
    out = _Objects()
    groups: dict[tuple[str, int], dict[str, Any]] = {}  # (top, group index) -> hparams + params
    per_fqn: dict[tuple[str, str], dict[str, Any]] = {}  # flattened: (top, fqn) -> hparams
    nested: dict[str, list[tuple[tuple[str | int, ...], Any]]] = {}
    # A model entry whose value DCP flattened (a dict ``get_extra_state()``): (top, key) -> leaves
    entry_leaves: dict[tuple[str, str], list[tuple[tuple[str | int, ...], Any]]] = {}
    tops_with_tensors = {k.split("/", 1)[0] for k in tensor_keys}
    optim_tops = _optimizer_tops(dcp)
    for fqn, b in sorted(dcp.objects.items()):
        value = _decode(storage, root, b, fqn, skipped, source)
        if value is _SKIP:
            continue
        path = _path_of(dcp, fqn)
        top, rest = str(path[0]), path[1:]
        if "/" in top:
            skipped.append(f"{fqn} (a name bytecheckpoint cannot key)")
        elif len(rest) == 3 and rest[0] == "param_groups" and type(rest[1]) is int and type(rest[2]) is str:
            groups.setdefault((top, rest[1]), {})[rest[2]] = value
        elif len(rest) == 1 and isinstance(rest[0], str) and rest[0].startswith("param_groups."):
            pfqn, _, hp = rest[0][len("param_groups."):].rpartition(".")
            if pfqn and hp != "params":
                per_fqn.setdefault((top, pfqn), {})[hp] = value
        elif top in tops_with_tensors and top not in optim_tops and rest and type(rest[0]) is str:
            # A state-dict entry (a module's ``_extra_state``), or one leaf of it when DCP
            # flattened its dict value: the value is rebuilt below.
            entry_leaves.setdefault((top, rest[0]), []).append((rest[1:], value))
        elif top in tops_with_tensors and rest:
            key = _plain_key(rest)
            if key is None:
                skipped.append(f"{fqn} (a name bytecheckpoint cannot key)")
            else:
                out.add(f"{top}/{key}", None, value)
        else:
            nested.setdefault(top, []).append((rest, value))
    for (top, entry), leaves in sorted(entry_leaves.items()):
        key = _plain_key((entry,))
        if key is None:
            skipped.append(f"{top}.{entry} (a name bytecheckpoint cannot key)")
        elif any(not path for path, _ in leaves) and len(leaves) > 1:
            skipped.append(f"{top}.{entry} (both a value and a dict of values)")
        else:
            out.add(f"{top}/{key}", None, _rebuild(leaves))  # e.g. a module's _extra_state
    for (top, index), hparams in sorted(groups.items()):
        params = hparams.pop("params", None)
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            skipped.append(f"{top}.param_groups.{index} (no list of parameter names)")
            continue
        for p in params:
            per_fqn.setdefault((top, p), {}).update(hparams)
    for (top, pfqn), hparams in sorted(per_fqn.items()):
        if "/" in pfqn:
            skipped.append(f"{top}.param_groups.{pfqn} (a name bytecheckpoint cannot key)")
            continue
        out.add(f"{top}/param_groups/{pfqn}", None, hparams)
    for top, leaves in sorted(nested.items()):
        value = _rebuild(leaves)
        for rank in range(world_size):  # per-rank state: the same value for every rank
            out.add(top, rank, value)
    return out


_SKIP = object()


def _decode(storage: Storage, root: str, b: Any, fqn: str, skipped: list[str], source: str) -> Any:
    if b.length > MAX_OBJECT_BYTES:
        skipped.append(f"{fqn} ({b.length} bytes, over {MAX_OBJECT_BYTES})")
        return _SKIP
    where = f"{source}: {fqn!r}"
    try:
        return read_plain_value(storage, posixpath.join(root, b.file), b.offset, b.length, source=where)
    except UnsafePickleError as exc:
        why = (f"a pickled {exc.global_name}, which could run code: not a plain value"
               if exc.global_name else _reason(exc, where))
        skipped.append(f"{fqn} ({why})")
    except CheckpointError as exc:
        skipped.append(f"{fqn} ({_reason(exc, where)})")
    return _SKIP


def _reason(exc: Exception, where: str) -> str:
    text = str(exc).removeprefix(f"{where}: ")
    return text if len(text) <= 160 else f"{text[:157]}..."


def _rebuild(leaves: list[tuple[tuple[str | int, ...], Any]]) -> Any:
    """A nested value from (path, leaf) pairs; a bare leaf when its path is empty."""
    if len(leaves) == 1 and not leaves[0][0]:
        return leaves[0][1]
    root: dict[Any, Any] = {}
    for path, value in leaves:
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if path:
            node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(type(k) is int for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node

