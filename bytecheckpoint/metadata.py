"""The global metadata file: ShardMeta / BasicMeta / ByteMeta for every stored box.

One msgpack document per checkpoint. Scalar facts (framework, layout, step, files) are plain
fields; the box table is columnar (numpy arrays stored as little-endian bytes), so a
checkpoint with a million boxes decodes in milliseconds and is only turned into Python
objects for the tensors a rank actually loads. Nothing in it is ever unpickled, and every
field is validated on read, because a checkpoint may come from an untrusted place.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from . import __version__
from .checksums import CHECKSUM_ALGORITHM, chunk_count
from .dtypes import itemsize
from .errors import CorruptCheckpointError, UnsafeCheckpointError
from .sharding import Box

FORMAT_NAME = "bytecheckpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.msgpack"

# Storage file names are plain names inside the checkpoint directory: nothing that can
# climb out of it ("..", "/", "\\") and nothing hidden.
_SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


@dataclass(frozen=True)
class TensorMeta:
    """BasicMeta of one logical tensor: its key (group/FQN), dtype and global shape."""

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

    def __post_init__(self) -> None:
        self._tensor_index = {t.key: i for i, t in enumerate(self.tensors)}
        self._file_index = {f.name: i for i, f in enumerate(self.files)}

    # -- queries ---------------------------------------------------------------------
    def tensor(self, key: str) -> TensorMeta | None:
        i = self._tensor_index.get(key)
        return None if i is None else self.tensors[i]

    def boxes_of(self, key: str) -> list[SavedBox]:
        """Every saved box of one tensor (built on demand from the columnar table)."""
        i = self._tensor_index.get(key)
        if i is None:
            return []
        b = self.boxes
        # Keys in the column's own dtype: a mixed-dtype search would copy the whole column.
        lo, hi = (int(x) for x in np.searchsorted(b.tensor, np.array([i, i + 1], dtype=b.tensor.dtype)))
        nd = len(self.tensors[i].shape)
        # One conversion per column for the tensor's rows, not one per box and field.
        dim_start = b.dim_start[lo:hi].tolist()
        files, offsets = b.file[lo:hi].tolist(), b.byte_offset[lo:hi].tolist()
        lengths, sum_start = b.byte_length[lo:hi].tolist(), b.checksum_start[lo:hi].tolist()
        out = []
        for s, f, off, length, cs in zip(dim_start, files, offsets, lengths, sum_start):
            n_chunks = chunk_count(length, self.chunk_bytes)
            out.append(SavedBox(
                key,
                Box(tuple(b.offsets[s : s + nd].tolist()), tuple(b.lengths[s : s + nd].tolist())),
                ByteMeta(self.files[f].name, off, length, tuple(b.checksums[cs : cs + n_chunks].tolist())),
            ))
        return out

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
        return msgpack.packb(doc, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "metadata") -> CheckpointMetadata:
        try:
            doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:
            raise CorruptCheckpointError(f"{source}: not a readable metadata file ({exc})") from exc
        try:
            return _decode(doc, source)
        except (CorruptCheckpointError, UnsafeCheckpointError):
            raise
        except Exception as exc:  # wrong types, missing fields
            raise CorruptCheckpointError(f"{source}: malformed metadata ({exc!r})") from exc


def _arr(a: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()



def check_file_name(name: str, source: str) -> str:
    if not isinstance(name, str) or not _SAFE_FILE_NAME.match(name) or ".." in name:
        raise UnsafeCheckpointError(
            f"{source}: names storage file {name!r}, which is not a plain file name inside the "
            "checkpoint directory; refusing to read it (the metadata is corrupt or hostile)"
        )
    return name


def _decode(doc: dict[str, Any], source: str) -> CheckpointMetadata:
    if doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{source}: not a bytecheckpoint metadata file")
    if not isinstance(doc.get("version"), int) or doc["version"] > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{source}: format version {doc.get('version')!r} is newer than this library "
            f"supports ({FORMAT_VERSION}); upgrade bytecheckpoint to read it"
        )
    checksum = doc["checksum"]
    if checksum["algorithm"] != CHECKSUM_ALGORITHM:
        raise CorruptCheckpointError(f"{source}: unknown checksum {checksum['algorithm']!r}")
    chunk_bytes = int(checksum["chunk_bytes"])
    if chunk_bytes <= 0:
        raise CorruptCheckpointError(f"{source}: bad checksum chunk size {chunk_bytes}")

    files = [
        FileMeta(check_file_name(n, source), int(size), int(rank), str(kind))
        for n, size, rank, kind in doc["files"]
    ]
    if len({f.name for f in files}) != len(files):
        raise CorruptCheckpointError(f"{source}: duplicate storage file names")

    t = doc["tensors"]
    keys, dtypes = t["key"], t["dtype"]
    tensor_ndim = np.frombuffer(t["ndim"], dtype="<i4").astype(np.int64)
    shape_flat = np.frombuffer(t["shape"], dtype="<i8").astype(np.int64)
    if not (len(keys) == len(dtypes) == len(tensor_ndim)) or int(tensor_ndim.sum()) != len(shape_flat):
        raise CorruptCheckpointError(f"{source}: tensor columns have inconsistent sizes")
    if np.any(shape_flat < 0) or np.any(tensor_ndim < 0):
        raise CorruptCheckpointError(f"{source}: a tensor has a negative shape")
    if not all(isinstance(k, str) for k in keys):
        raise CorruptCheckpointError(f"{source}: a tensor key is not a string")
    sizes_by_dtype = {d: itemsize(d) for d in set(dtypes)}  # allowlist check, once per dtype
    shape_start = np.concatenate([[0], np.cumsum(tensor_ndim)[:-1]]).astype(np.int64)
    dims = shape_flat.tolist()
    tensors = [
        TensorMeta(k, d, tuple(dims[s : s + n]))
        for k, d, s, n in zip(keys, dtypes, shape_start.tolist(), tensor_ndim.tolist())
    ]

    raw = doc["boxes"]
    tensor_col = np.frombuffer(raw["tensor"], dtype="<i4").astype(np.int32)
    n = len(tensor_col)
    if n and (tensor_col.min() < 0 or tensor_col.max() >= len(tensors)):
        raise CorruptCheckpointError(f"{source}: box refers to an unknown tensor")
    if n and np.any(np.diff(tensor_col) < 0):
        raise CorruptCheckpointError(f"{source}: box table is not sorted by tensor")
    box_ndim = tensor_ndim[tensor_col] if n else np.zeros(0, dtype=np.int64)
    dim_start = np.concatenate([[0], np.cumsum(box_ndim)[:-1]]).astype(np.int64) if n else box_ndim
    offsets = np.frombuffer(raw["offsets"], dtype="<i8").astype(np.int64)
    lengths = np.frombuffer(raw["lengths"], dtype="<i8").astype(np.int64)
    if len(offsets) != int(box_ndim.sum()) or len(lengths) != len(offsets):
        raise CorruptCheckpointError(f"{source}: box offsets/lengths have the wrong size")
    file_col = np.frombuffer(raw["file"], dtype="<i4").astype(np.int32)
    byte_offset = np.frombuffer(raw["byte_offset"], dtype="<i8").astype(np.int64)
    byte_length = np.frombuffer(raw["byte_length"], dtype="<i8").astype(np.int64)
    checksums = np.frombuffer(raw["checksums"], dtype="<u8").astype(np.uint64)
    if not (len(file_col) == len(byte_offset) == len(byte_length) == n):
        raise CorruptCheckpointError(f"{source}: box columns have different lengths")
    if n and (file_col.min() < 0 or file_col.max() >= len(files)):
        raise CorruptCheckpointError(f"{source}: box refers to an unknown storage file")
    n_chunks = np.where(byte_length > 0, -(-byte_length // chunk_bytes), 0)
    checksum_start = np.concatenate([[0], np.cumsum(n_chunks)[:-1]]).astype(np.int64) if n else n_chunks
    if int(n_chunks.sum()) != len(checksums):
        raise CorruptCheckpointError(f"{source}: checksum table has the wrong size")

    table = BoxTable(tensor_col, offsets, lengths, dim_start, file_col, byte_offset,
                     byte_length, checksum_start, checksums)
    tensor_itemsize = np.array([sizes_by_dtype[d] for d in dtypes], dtype=np.int64)
    _check_boxes(table, shape_flat, shape_start, tensor_itemsize, files, source)

    objects = []
    file_names = {f.name for f in files}  # once, not per object: thousands of each at scale
    for key, rank, fname, off, length, sums in doc["objects"]:
        if fname not in file_names:
            check_file_name(fname, source)
            raise CorruptCheckpointError(f"{source}: object {key!r} refers to unknown file")
        objects.append(ObjectMeta(str(key), None if rank is None else int(rank),
                                  ByteMeta(fname, int(off), int(length), tuple(sums))))

    return CheckpointMetadata(
        framework=str(doc["framework"]),
        world_size=int(doc["world_size"]),
        tensors=tensors,
        boxes=table,
        objects=objects,
        files=files,
        chunk_bytes=chunk_bytes,
        layout=dict(doc.get("layout") or {}),
        step=doc.get("step"),
        user_metadata=dict(doc.get("user_metadata") or {}),
        created_at=float(doc.get("created_at") or 0.0),
        library_version=str(doc.get("library_version", "")),
        loader=list(doc.get("loader") or []),
    )


def _check_boxes(b: BoxTable, shape_flat: np.ndarray, shape_start: np.ndarray,
                 tensor_itemsize: np.ndarray, files: list[FileMeta], source: str) -> None:
    """Vectorised bounds checks: boxes inside their tensor, byte ranges inside their file."""
    if not len(b):
        return
    if np.any(b.offsets < 0) or np.any(b.lengths < 0):
        raise CorruptCheckpointError(f"{source}: negative box offsets or lengths")
    ndim_per_box = np.diff(np.append(b.dim_start, len(b.offsets)))
    dim_owner = np.repeat(np.arange(len(b)), ndim_per_box)
    dim_pos = np.arange(len(b.offsets)) - b.dim_start[dim_owner]
    global_dim = shape_start[b.tensor[dim_owner]] + dim_pos
    if len(b.offsets) and np.any(b.offsets + b.lengths > shape_flat[global_dim]):
        raise CorruptCheckpointError(f"{source}: a box lies outside its tensor's shape")
    numel = np.ones(len(b), dtype=np.int64)
    has_dims = ndim_per_box > 0  # 0-dim tensors have one element and no lengths
    if has_dims.any():
        numel[has_dims] = np.multiply.reduceat(b.lengths, b.dim_start[has_dims])
    if np.any(numel * tensor_itemsize[b.tensor] != b.byte_length):
        raise CorruptCheckpointError(f"{source}: a box's byte length disagrees with its shape")
    file_sizes = np.array([f.size for f in files], dtype=np.int64)[b.file]
    if np.any(b.byte_offset < 0) or np.any(b.byte_offset + b.byte_length > file_sizes):
        raise CorruptCheckpointError(f"{source}: a box's bytes lie outside its storage file")
