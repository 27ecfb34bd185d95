"""The global metadata file: ShardMeta / BasicMeta / ByteMeta for every stored box.

One msgpack document per checkpoint. Scalar facts (framework, layout, step, files) are plain
fields; the box table is columnar (numpy arrays stored as little-endian bytes), so a
checkpoint with a million boxes decodes in milliseconds and is only turned into Python
objects for the tensors a rank actually loads. Nothing in it is ever unpickled, and every
field is validated on read, because a checkpoint may come from an untrusted place.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import numpy as np
import xxhash

from .._version import __version__
from ..errors import CorruptCheckpointError, NewerFormatError, UnsafeCheckpointError
from ..runtime.gc_pause import gc_paused
from ..storage.base import COMMIT_MARKER_NAME
from .boxes import Box, overlaps
from .checks import DAMAGED, MAX_BYTES, check_boxes, check_files, fail, tensor_numel
from .checksums import CHECKSUM_ALGORITHM, chunk_count
from .dtypes import DTYPE_NAMES, itemsize

FORMAT_NAME = "bytecheckpoint"
# 1: the msgpack document alone. 2: the document behind MAGIC and its xxh3-128 digest.
# 3: storage files may hold padding entries that align the pieces (format.file_headers).
# 4: padding entries may be up to 4095 bytes, placing large pieces for direct writes.
FORMAT_VERSION = 4
METADATA_FILE = COMMIT_MARKER_NAME  # written last: its presence is the commit
MAGIC = b"BCPMETA\x00"
_ENVELOPE = len(MAGIC) + 16

# Storage file names are plain names inside the checkpoint directory: nothing that can
# climb out of it ("..", "/", "\\") and nothing hidden. "=" is allowed: the latest pointer
# names checkpoints such as Lightning's "epoch=0-step=8.ckpt".
_SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,200}$")


class TensorMeta(NamedTuple):
    """BasicMeta of one logical tensor: its key (group/FQN), dtype and global shape (a named
    tuple: a load builds one per tensor, and a million of them must decode in milliseconds)."""

    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def group(self) -> str:
        return self.key.split("/", 1)[0]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class ByteMeta:
    """Where a piece's bytes live: file, absolute byte range, chunk checksums."""

    file: str
    byte_offset: int
    byte_length: int
    checksums: tuple[int, ...]


@dataclass(frozen=True)
class SavedBox:
    """A ShardMeta (the box, in global coordinates) with its ByteMeta."""

    key: str
    box: Box
    bytes: ByteMeta


@dataclass(frozen=True)
class ObjectMeta:
    """A packed non-tensor value; ``rank`` is None when it was saved once for all ranks."""

    key: str
    rank: int | None
    bytes: ByteMeta


@dataclass(frozen=True)
class FileMeta:
    name: str
    size: int
    rank: int
    kind: str


@dataclass
class BoxTable:
    """Columnar boxes, sorted by tensor index. Arrays are int64 unless noted."""

    tensor: np.ndarray  # int32 index into tensors
    offsets: np.ndarray  # flattened, ndim values per box
    lengths: np.ndarray
    dim_start: np.ndarray  # where each box's offsets/lengths begin
    file: np.ndarray  # int32 index into files
    byte_offset: np.ndarray
    byte_length: np.ndarray
    checksum_start: np.ndarray
    checksums: np.ndarray  # uint64, flattened

    def __len__(self) -> int:
        return len(self.tensor)


@dataclass
class CheckpointMetadata:
    framework: str
    world_size: int
    tensors: list[TensorMeta]
    boxes: BoxTable
    objects: list[ObjectMeta]
    files: list[FileMeta]
    chunk_bytes: int
    layout: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    user_metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    library_version: str = __version__
    loader: list[dict[str, Any]] = field(default_factory=list)
    format_version: int = FORMAT_VERSION  # as read; a save writes the current one

    def __post_init__(self) -> None:
        self._tensor_index = {t.key: i for i, t in enumerate(self.tensors)}
        self._file_index = {f.name: i for i, f in enumerate(self.files)}

    # -- queries ---------------------------------------------------------------------
    def tensor(self, key: str) -> TensorMeta | None:
        i = self._tensor_index.get(key)
        return None if i is None else self.tensors[i]

    def boxes_of(self, key: str, touching: Sequence[Box] | None = None) -> list[SavedBox]:
        """Every saved box of one tensor (built on demand from the columnar table); with
        ``touching``, only those that overlap one of those boxes (a load's targets: in a
        same-layout load one of the world's boxes, and the others are never built)."""
        i = self._tensor_index.get(key)
        if i is None:
            return []
        rows = self._rows()
        lo, hi = rows[i], rows[i + 1]
        if lo == hi:
            return []
        b = self.boxes
        nd = len(self.tensors[i].shape)
        # A tensor's rows are consecutive, and so are their dimensions and checksums (each
        # column's start is the running sum of the ones before): one conversion per column.
        d0 = int(b.dim_start[lo])
        offsets = b.offsets[d0 : d0 + (hi - lo) * nd].tolist()
        lengths = b.lengths[d0 : d0 + (hi - lo) * nd].tolist()
        files, positions = b.file[lo:hi].tolist(), b.byte_offset[lo:hi].tolist()
        sizes, sum_start = b.byte_length[lo:hi].tolist(), b.checksum_start[lo:hi].tolist()
        c0 = sum_start[0]
        sums = b.checksums[c0 : sum_start[-1] + chunk_count(sizes[-1], self.chunk_bytes)].tolist()
        names = self._file_names()
        out = []
        for j, (f, off, length, cs) in enumerate(zip(files, positions, sizes, sum_start)):
            d = j * nd
            at, size = offsets[d : d + nd], lengths[d : d + nd]
            if touching is not None and not any(overlaps(at, size, t) for t in touching):
                continue
            out.append(SavedBox(
                key,
                Box(tuple(at), tuple(size)),
                ByteMeta(names[f], off, length,
                         tuple(sums[cs - c0 : cs - c0 + chunk_count(length, self.chunk_bytes)])),
            ))
        return out

    def _file_names(self) -> list[str]:
        names = self.__dict__.get("_names")
        if names is None:
            names = self.__dict__["_names"] = [f.name for f in self.files]
        return names

    def _rows(self) -> list[int]:
        """Row bounds of every tensor in the box table: tensor ``i`` is rows
        ``[rows[i], rows[i + 1])``; one search for all tensors, on the first query."""
        rows = self.__dict__.get("_row_bounds")
        if rows is None:
            b = self.boxes
            wanted = np.arange(len(self.tensors) + 1, dtype=b.tensor.dtype)
            rows = self.__dict__["_row_bounds"] = np.searchsorted(b.tensor, wanted).tolist()
        return rows

    def file(self, name: str) -> FileMeta:
        return self.files[self._file_index[name]]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def bytes_per_rank(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for f in self.files:
            out[f.rank] = out.get(f.rank, 0) + f.size
        return out

    # -- encoding --------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        b = self.boxes
        doc = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "library_version": self.library_version,
            "created_at": self.created_at,
            "framework": self.framework,
            "world_size": self.world_size,
            "layout": self.layout,
            "step": self.step,
            "user_metadata": self.user_metadata,
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "chunk_bytes": self.chunk_bytes},
            "files": [[f.name, f.size, f.rank, f.kind] for f in self.files],
            "tensors": {
                "key": [t.key for t in self.tensors],
                "dtype": [t.dtype for t in self.tensors],
                "ndim": _arr(np.array([len(t.shape) for t in self.tensors], dtype=np.int64), "<i4"),
                "shape": _arr(np.array([d for t in self.tensors for d in t.shape], dtype=np.int64), "<i8"),
            },
            "boxes": {
                "tensor": _arr(b.tensor, "<i4"),
                "offsets": _arr(b.offsets, "<i8"),
                "lengths": _arr(b.lengths, "<i8"),
                "file": _arr(b.file, "<i4"),
                "byte_offset": _arr(b.byte_offset, "<i8"),
                "byte_length": _arr(b.byte_length, "<i8"),
                "checksums": _arr(b.checksums, "<u8"),
            },
            "objects": [
                [o.key, o.rank, o.bytes.file, o.bytes.byte_offset, o.bytes.byte_length,
                 list(o.bytes.checksums)]
                for o in self.objects
            ],
            "loader": self.loader,
        }
        return pack_document(doc)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, source: str = "metadata"
                   ) -> CheckpointMetadata:
        """Decode and validate a metadata file (any supported format version)."""
        return cls.from_document(unpack_document(data, source=source), source=source)

    @classmethod
    def from_document(cls, doc: Any, *, source: str = "metadata") -> CheckpointMetadata:
        """Validate a decoded metadata document (see :func:`unpack_document`) field by field and
        against itself; the one place every reader of a checkpoint's metadata goes through."""
        try:
            with gc_paused():  # an object per tensor: see gc_paused
                return _decode(doc, source)
        except CorruptCheckpointError:
            raise
        except Exception as exc:  # a shape of document the checks below did not foresee
            raise CorruptCheckpointError(f"{source}: malformed metadata ({exc!r}); {DAMAGED}") from exc


def pack_document(doc: dict[str, Any]) -> bytes:
    """The metadata file for a document: ``MAGIC``, the xxh3-128 digest of the body, the body
    (msgpack). The digest catches any flipped bit, also in fields that stay plausible."""
    body = msgpack.packb(doc, use_bin_type=True)
    return MAGIC + xxhash.xxh3_128_digest(body) + body


def unpack_document(data: bytes | bytearray | memoryview, *, source: str = "metadata") -> Any:
    """The document of a metadata file, its checksum checked (format 1 files have none)."""
    view = memoryview(data).cast("B")
    head = bytes(view[: len(MAGIC)])
    if head[:-1] == MAGIC[:-1] and head != MAGIC:  # our magic with another last byte: a later envelope
        raise NewerFormatError(
            f"{source}: the metadata's header {head!r} is of a format newer than this library "
            f"supports ({FORMAT_VERSION}); upgrade bytecheckpoint to read it")
    if head == MAGIC:
        body = view[_ENVELOPE:]
        if len(view) < _ENVELOPE or xxhash.xxh3_128_digest(body) != bytes(view[len(MAGIC) : _ENVELOPE]):
            raise CorruptCheckpointError(f"{source}: the metadata's checksum does not match its contents; "
                                         f"{DAMAGED}")
        sealed = True
    else:
        body, sealed = view, False
    try:
        doc = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        # _short: msgpack's ExtraData carries (and its repr prints) every byte after the first object
        raise CorruptCheckpointError(f"{source}: not a readable metadata file ({_short(exc)})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{source}: not a bytecheckpoint metadata file")
    version = doc.get("version")
    if type(version) is not int or version < 1:
        raise _fail(source, f"format version {version!r}")
    if version > FORMAT_VERSION:
        raise NewerFormatError(
            f"{source}: format version {version} is newer than this library supports "
            f"({FORMAT_VERSION}); upgrade bytecheckpoint to read it"
        )
    if sealed != (version >= 2):
        raise _fail(source, f"format version {version} " + (
            "has a checksum header, which only versions 2 and later have" if sealed
            else "lacks the checksum header every version from 2 has"))
    return doc


def _arr(a: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def check_file_name(name: str, source: str) -> str:
    if not isinstance(name, str) or not _SAFE_FILE_NAME.fullmatch(name) or ".." in name:
        raise UnsafeCheckpointError(
            f"{source}: names storage file {name!r}, which is not a plain file name inside the "
            "checkpoint directory; refusing to read it (the metadata is corrupt or hostile)"
        )
    return name


# -- typed fields ----------------------------------------------------------------------------

_I64 = (1 << 63) - 1
_MAX_TEXT = 4096  # framework, kinds, versions: short words
_MAX_TIME = 253402300799.0  # 9999-12-31


def _fail(source: str, what: str) -> CorruptCheckpointError:
    return fail(source, f"malformed metadata: {what}")


def _int(value: Any, source: str, what: str, lo: int = 0, hi: int = _I64) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _fail(source, f"{what} is {value!r}, not an integer in {lo}..{hi}")
    return value


def _str(value: Any, source: str, what: str, max_len: int = _MAX_TEXT) -> str:
    if type(value) is not str or len(value) > max_len:
        raise _fail(source, f"{what} is {_short(value)}, not a string of at most {max_len} characters")
    return value


def _list(value: Any, source: str, what: str) -> list[Any]:
    if type(value) is not list:
        raise _fail(source, f"{what} is {_short(value)}, not a list")
    return value


def _dict(value: Any, source: str, what: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise _fail(source, f"{what} is {_short(value)}, not a map")
    return value


def _column(raw: dict[str, Any], name: str, dtype: str, source: str, what: str) -> np.ndarray:
    value = raw.get(name)
    size = np.dtype(dtype).itemsize
    if type(value) is not bytes or len(value) % size:
        raise _fail(source, f"column {what}.{name} is {_short(value)}, not packed {dtype} values")
    return np.frombuffer(value, dtype=dtype).astype(dtype[1:])


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _decode(doc: Any, source: str) -> CheckpointMetadata:
    doc = _dict(doc, source, "the document")
    checksum = _dict(doc.get("checksum"), source, "checksum")
    if checksum.get("algorithm") != CHECKSUM_ALGORITHM:
        raise _fail(source, f"unknown checksum {_short(checksum.get('algorithm'))}")
    chunk_bytes = _int(checksum.get("chunk_bytes"), source, "checksum chunk size", 1, 1 << 40)
    world_size = _int(doc.get("world_size"), source, "world_size", 1, 1 << 24)

    files = []
    for i, entry in enumerate(_list(doc.get("files"), source, "files")):
        if type(entry) is not list or len(entry) != 4:
            raise _fail(source, f"files[{i}] is {_short(entry)}, not [name, size, rank, kind]")
        name, size, rank, kind = entry
        files.append(FileMeta(check_file_name(name, source),
                              _int(size, source, f"the size of file {name!r}", 0, MAX_BYTES),
                              _int(rank, source, f"the rank of file {name!r}", 0, world_size - 1),
                              _str(kind, source, f"the kind of file {name!r}", 64)))
    file_names = [f.name for f in files]
    if len(set(file_names)) != len(files):
        raise _fail(source, "two storage files have the same name")
    check_files(source, file_names, [f.size for f in files])
    file_sizes = np.array([f.size for f in files], dtype=np.int64)

    t = _dict(doc.get("tensors"), source, "tensors")
    keys, dtypes = _list(t.get("key"), source, "tensor keys"), _list(t.get("dtype"), source, "tensor dtypes")
    tensor_ndim = _column(t, "ndim", "<i4", source, "tensors").astype(np.int64)
    shape_flat = _column(t, "shape", "<i8", source, "tensors")
    if not (len(keys) == len(dtypes) == len(tensor_ndim)) or int(tensor_ndim.sum()) != len(shape_flat):
        raise _fail(source, "tensor columns have inconsistent sizes")
    if not all(type(k) is str for k in keys) or (keys and max(map(len, keys)) > 1 << 16):
        bad = next(k for k in keys if type(k) is not str or len(k) > 1 << 16)
        raise _fail(source, f"tensor key {_short(bad)} is not a string of at most {1 << 16} characters")
    if len(set(keys)) != len(keys):
        dup = next(k for k, c in collections.Counter(keys).items() if c > 1)
        raise _fail(source, f"tensor {dup!r} is listed twice")
    sizes_by_dtype: dict[str, int] = {}
    for k, d in zip(keys, dtypes):
        if type(d) is not str or d not in sizes_by_dtype:
            if type(d) is not str or d not in DTYPE_NAMES:
                raise _fail(source, f"tensor {k!r} has unknown dtype {_short(d)}")
            sizes_by_dtype[d] = itemsize(d)
    tensor_itemsize = np.array([sizes_by_dtype[d] for d in dtypes], dtype=np.int64)
    shape_start = np.concatenate([[0], np.cumsum(tensor_ndim)[:-1]]).astype(np.int64)
    numel_t = tensor_numel(source, keys, tensor_ndim, shape_flat, shape_start, tensor_itemsize)

    raw = _dict(doc.get("boxes"), source, "boxes")
    tensor_col = _column(raw, "tensor", "<i4", source, "boxes")
    n = len(tensor_col)
    if n and (tensor_col.min() < 0 or tensor_col.max() >= len(keys)):
        raise _fail(source, "a box refers to an unknown tensor")
    if n and np.any(np.diff(tensor_col) < 0):
        raise _fail(source, "the box table is not sorted by tensor")
    box_ndim = tensor_ndim[tensor_col]
    dim_start = np.concatenate([[0], np.cumsum(box_ndim)[:-1]]).astype(np.int64) if n else box_ndim
    offsets = _column(raw, "offsets", "<i8", source, "boxes")
    lengths = _column(raw, "lengths", "<i8", source, "boxes")
    if len(offsets) != int(box_ndim.sum()) or len(lengths) != len(offsets):
        raise _fail(source, "box offsets/lengths have the wrong size")
    file_col = _column(raw, "file", "<i4", source, "boxes")
    byte_offset = _column(raw, "byte_offset", "<i8", source, "boxes")
    byte_length = _column(raw, "byte_length", "<i8", source, "boxes")
    checksums = _column(raw, "checksums", "<u8", source, "boxes")
    if not (len(file_col) == len(byte_offset) == len(byte_length) == n):
        raise _fail(source, "box columns have different lengths")
    if n and (file_col.min() < 0 or file_col.max() >= len(files)):
        raise _fail(source, "a box refers to an unknown storage file")
    if n and (byte_length.min() < 0 or byte_length.max() > MAX_BYTES):
        raise _fail(source, "a box has a negative or huge byte length")
    n_chunks = np.where(byte_length > 0, -(-byte_length // chunk_bytes), 0)
    checksum_start = np.concatenate([[0], np.cumsum(n_chunks)[:-1]]).astype(np.int64) if n else n_chunks
    if int(n_chunks.sum()) != len(checksums):
        raise _fail(source, "the checksum table has the wrong size")

    objects = _objects(doc.get("objects"), source, world_size, chunk_bytes, set(file_names), set(keys))
    file_index = {name: i for i, name in enumerate(file_names)}
    check_boxes(
        source, keys, shape_flat, shape_start, tensor_ndim, numel_t, tensor_itemsize, tensor_col,
        dim_start, offsets, lengths, file_col, byte_offset, byte_length, file_names, file_sizes,
        (np.array([file_index[o.bytes.file] for o in objects], dtype=np.int64),
         np.array([o.bytes.byte_offset for o in objects], dtype=np.int64),
         np.array([o.bytes.byte_length for o in objects], dtype=np.int64), [o.key for o in objects]),
    )

    dims = shape_flat.tolist()
    tensors = [
        TensorMeta(k, d, tuple(dims[s : s + nd]))
        for k, d, s, nd in zip(keys, dtypes, shape_start.tolist(), tensor_ndim.tolist())
    ]
    table = BoxTable(tensor_col, offsets, lengths, dim_start, file_col, byte_offset,
                     byte_length, checksum_start, checksums)
    step = doc.get("step")
    created_at = doc.get("created_at", 0.0)
    if type(created_at) not in (int, float) or not 0 <= created_at <= _MAX_TIME:
        raise _fail(source, f"created_at is {_short(created_at)}, not a time in seconds since 1970")
    loader = _list(doc.get("loader", []), source, "loader")
    for i, entry in enumerate(loader):
        _dict(entry, source, f"loader[{i}]")
    return CheckpointMetadata(
        framework=_str(doc.get("framework"), source, "framework", 64),
        world_size=world_size,
        tensors=tensors,
        boxes=table,
        objects=objects,
        files=files,
        chunk_bytes=chunk_bytes,
        layout=_dict(doc.get("layout", {}), source, "layout"),
        step=None if step is None else _int(step, source, "step"),
        user_metadata=_dict(doc.get("user_metadata", {}), source, "user_metadata"),
        created_at=float(created_at),
        library_version=_str(doc.get("library_version", ""), source, "library_version", 64),
        loader=loader,
        format_version=_int(doc.get("version"), source, "version", 1, FORMAT_VERSION),
    )


def _objects(raw: Any, source: str, world_size: int, chunk_bytes: int, file_names: set[str],
             tensor_keys: set[str]) -> list[ObjectMeta]:
    """Packed objects, each checked: its rank below the world size, its bytes in a known file,
    as many checksums as chunks; no (key, rank) twice, no key both shared and per rank."""
    objects = []
    seen: dict[str, set[int | None]] = {}
    for i, entry in enumerate(_list(raw, source, "objects")):
        if type(entry) is not list or len(entry) != 6:
            raise _fail(source, f"objects[{i}] is {_short(entry)}, not [key, rank, file, offset, "
                                "length, checksums]")
        key, rank, fname, off, length, sums = entry
        key = _str(key, source, f"the key of objects[{i}]", 1 << 16)
        what = f"object {key!r}"
        if rank is not None:
            _int(rank, source, f"the rank of {what}", 0, world_size - 1)
        if fname not in file_names:
            check_file_name(fname, source)
            raise _fail(source, f"{what} refers to unknown storage file {fname!r}")
        off = _int(off, source, f"the byte offset of {what}", 0, MAX_BYTES)
        length = _int(length, source, f"the byte length of {what}", 1, MAX_BYTES)  # never empty
        sums = _list(sums, source, f"the checksums of {what}")
        if len(sums) != chunk_count(length, chunk_bytes):
            raise _fail(source, f"{what} has {len(sums)} checksums for "
                                f"{chunk_count(length, chunk_bytes)} chunks")
        for s in sums:
            _int(s, source, f"a checksum of {what}", 0, (1 << 64) - 1)
        ranks = seen.setdefault(key, set())
        if rank in ranks or (ranks and (rank is None) != (None in ranks)):
            raise _fail(source, f"{what} is stored twice (rank {rank}) or both shared and per rank")
        if key in tensor_keys:
            raise _fail(source, f"{what} has the key of a tensor")
        ranks.add(rank)
        objects.append(ObjectMeta(key, rank, ByteMeta(fname, off, length, tuple(sums))))
    return objects
