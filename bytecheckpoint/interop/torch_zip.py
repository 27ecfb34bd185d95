"""Reading one ``torch.save`` blob (a zip archive) in place, without unpickling it normally.

``torch.save`` writes a zip of stored (uncompressed) records: ``<prefix>/data.pkl`` (a pickle
naming ``torch._utils._rebuild_tensor_v2`` and storage types, with persistent ids for the
storages), ``<prefix>/byteorder`` and ``<prefix>/data/<key>`` (the raw storage bytes). DCP
writes each tensor chunk and each non-tensor value as one such blob at a byte range of a
``.distcp`` file. This module finds where a tensor's raw bytes lie inside the blob (so a load
reads them with a ranged read, like any stored box) and decodes plain values; the pickle goes
through :mod:`.safe_pickle`, the zip directory through :mod:`zipfile` (which runs no code).
"""

from __future__ import annotations

import bisect
import io
import math
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError
from ..format.dtypes import DTYPE_NAMES
from ..storage import Storage
from .safe_pickle import PlainValueTooLargeError, is_plain, plain_globals, safe_loads, short

_BLOCK = 4096  # the head (data.pkl) and tail (zip directory) of a blob: read once each
MAX_PICKLE = 16 << 20  # a data.pkl larger than this is no plain value or tensor header
# Legacy storage class names torch.save uses for each dtype (torch.storage's table).
_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
}


class TorchBlobError(CorruptCheckpointError):
    """A ``torch.save`` blob that cannot be read safely (not a zip, a missing record, a value
    needing code to rebuild, a layout this reader does not take)."""


@dataclass(frozen=True)
class TensorLocation:
    """Where a saved tensor's raw bytes lie in the file that holds the blob (row-major)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    length: int


class BlobEnds:
    """The head and tail blocks (``_BLOCK``) of many blobs of one file, read in a few
    coalesced requests, where a blob read alone costs two (its head, then its zip directory):
    a DCP file of hundreds of small tensors is then a handful of reads. Ends less than ``gap``
    apart are read as one request of at most ``max_read`` bytes; only the ends are kept (at
    most three blocks a blob), so the memory is the blobs' count's, not their bytes'. A request
    that fails is left out: its blobs read their ends themselves, and fail there with their
    own error."""

    def __init__(self, storage: Storage, path: str, blobs: list[tuple[int, int]],
                 gap: int = 64 << 10, max_read: int = 8 << 20) -> None:
        wanted: list[tuple[int, int]] = []
        for start, length in blobs:
            last = max(0, (length - 1) // _BLOCK)
            wanted.append((start, start + min(length, _BLOCK)))
            wanted.append((start + max(0, last - 1) * _BLOCK, start + length))  # the directory
        keep = _merged(wanted, 0, None)  # the bytes kept: the ends, overlaps joined
        self._starts: list[int] = []
        self._data: list[bytes] = []
        for lo, hi in _merged(keep, gap, max_read):
            try:
                data = memoryview(storage.read(path, lo, hi - lo))
            except Exception:  # noqa: BLE001 (see the class: the blob's own read names it)
                continue
            k = bisect.bisect_left(keep, [lo])
            while k < len(keep) and keep[k][0] < hi:  # the kept ranges inside this request
                k_lo, k_hi = keep[k]
                self._starts.append(k_lo)
                self._data.append(bytes(data[k_lo - lo : k_hi - lo]))
                k += 1

    @property
    def held_bytes(self) -> int:
        return sum(len(d) for d in self._data)

    def get(self, offset: int, n: int) -> bytes | None:
        """Bytes ``[offset, offset + n)`` of the file, or None where they were not read."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset + n > self._starts[i] + len(self._data[i]):
            return None
        lo = offset - self._starts[i]
        return self._data[i][lo : lo + n]


def _merged(ranges: list[tuple[int, int]] | list[list[int]], gap: int, most: int | None) -> list[list[int]]:
    """``ranges`` sorted and joined where less than ``gap`` bytes apart (overlapping at
    ``gap`` 0), no joined range longer than ``most`` unless one range alone is."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo - out[-1][1] <= gap and (most is None or max(hi, out[-1][1]) - out[-1][0] <= most):
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``[start, start + length)`` of a storage file; the first
    and last block are read once and cached (zipfile reads small pieces of both), or taken
    from ``ends`` where they were read with other blobs' (``BlobEnds``)."""

    def __init__(self, storage: Storage, path: str, start: int, length: int,
                 ends: BlobEnds | None = None) -> None:
        self.storage, self.path, self.start, self.length = storage, path, start, length
        self.pos = 0
        self._cache: dict[int, bytes] = {}
        self._ends = ends

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _block(self, index: int) -> bytes:
        if index not in self._cache:
            lo = index * _BLOCK
            n = min(_BLOCK, self.length - lo)
            known = self._ends.get(self.start + lo, n) if self._ends is not None else None
            self._cache[index] = known if known is not None else bytes(
                self.storage.read(self.path, self.start + lo, n))
        return self._cache[index]

    def read(self, size: int = -1) -> bytes:
        end = self.length if size is None or size < 0 else min(self.length, self.pos + size)
        if end <= self.pos:
            return b""
        if end - self.pos > 2 * _BLOCK:  # a large record: read it directly
            data = bytes(self.storage.read(self.path, self.start + self.pos, end - self.pos))
        else:
            parts = [self._block(i) for i in range(self.pos // _BLOCK, (end - 1) // _BLOCK + 1)]
            joined = b"".join(parts)
            first = (self.pos // _BLOCK) * _BLOCK
            data = joined[self.pos - first : end - first]
        self.pos = end
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class _StorageRef:
    def __init__(self, dtype: str, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _TensorRef:
    def __init__(self, args: tuple[Any, ...], version: int) -> None:
        self.args = args
        self.version = version  # 2: a typed storage; 3: untyped storage, the dtype in args[6]


class _StorageType(str):
    pass


class _Dtype(str):
    """A dtype the pickle names (``torch.float8_e4m3fn``): its bytecheckpoint name."""


# torch.storage.UntypedStorage: the storage of _rebuild_tensor_v3 (dtypes without a legacy
# storage class: float8, uint16/32/64), its element count in bytes.
_UNTYPED = _StorageType("untyped")


def _tensor_globals() -> dict[str, Any]:
    out = plain_globals()

    def rebuild_v2(*args: Any) -> _TensorRef:
        return _TensorRef(args, 2)

    def rebuild_v3(*args: Any) -> _TensorRef:
        return _TensorRef(args, 3)

    out["torch._utils._rebuild_tensor_v2"] = rebuild_v2
    out["torch._utils._rebuild_tensor_v3"] = rebuild_v3
    for name, dtype in _STORAGE_DTYPES.items():
        out[f"torch.{name}"] = _StorageType(dtype)
    out["torch.storage.UntypedStorage"] = _UNTYPED
    for name in DTYPE_NAMES:
        out[f"torch.{name}"] = _Dtype(name)
    return out


def _persistent(source: str) -> Any:
    def load(pid: Any) -> _StorageRef:
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and type(pid[2]) is str and type(pid[4]) is int
                and pid[4] >= 0):
            return _StorageRef(str(pid[1]), pid[2], pid[4])
        raise TorchBlobError(f"{source}: the tensor refers to storage {short(pid)}, not one torch.save "
                             "writes for a plain tensor")
    return load


class _Blob:
    """The zip directory of one blob and its records' places."""

    def __init__(self, storage: Storage, path: str, start: int, length: int, source: str,
                 ends: BlobEnds | None = None) -> None:
        self.window = _Window(storage, path, start, length, ends)
        self.start, self.length, self.source = start, length, source
        try:
            self.zip = zipfile.ZipFile(self.window)  # reads only the directory
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise TorchBlobError(f"{source}: not a torch.save zip archive ({exc}); DCP files written "
                                 "by torch older than 1.6 or by another writer are not read") from exc
        names = [i.filename for i in self.zip.infolist()]
        pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise TorchBlobError(f"{source}: the archive has no single <name>/data.pkl record")
        self.prefix = pkl[0][: -len("data.pkl")]

    def record(self, name: str, max_size: int | None = None) -> zipfile.ZipInfo:
        try:
            info = self.zip.getinfo(self.prefix + name)
        except KeyError:
            raise TorchBlobError(f"{self.source}: the archive lacks its {name!r} record") from None
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise TorchBlobError(f"{self.source}: record {name!r} is compressed; torch.save never "
                                 "compresses, so the blob is damaged or foreign")
        if max_size is not None and info.file_size > max_size:
            raise TorchBlobError(f"{self.source}: record {name!r} is {info.file_size} bytes, over "
                                 f"{max_size}")
        return info

    def read(self, name: str, max_size: int) -> bytes:
        start, size = self.data_range(self.record(name, max_size))
        self.window.seek(start)
        data = self.window.read(size)
        if len(data) != size:
            raise TorchBlobError(f"{self.source}: record {name!r} is truncated")
        return data

    def data_range(self, info: zipfile.ZipInfo) -> tuple[int, int]:
        """(offset in the blob, size) of a stored record's bytes, from its local header."""
        self.window.seek(info.header_offset)
        head = self.window.read(30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            raise TorchBlobError(f"{self.source}: bad local header of record {info.filename!r}")
        n, m = struct.unpack("<HH", head[26:30])
        name = self.window.read(n)
        if name != info.filename.encode():
            raise TorchBlobError(f"{self.source}: record {info.filename!r} has another name in its "
                                 "local header")
        # The extra field's length places the record's bytes, and no checksum guards them (DCP
        # stores none): it must be the chain of (id, size) entries it frames, as torch.save
        # writes it, or a flipped length would move every byte of the tensor unseen.
        if not _extra_chain(self.window.read(m), m):
            raise TorchBlobError(f"{self.source}: record {info.filename!r} has a malformed extra "
                                 "field in its local header; the blob is damaged")
        start = info.header_offset + 30 + n + m
        if start + info.file_size > self.length:
            raise TorchBlobError(f"{self.source}: record {info.filename!r} runs past the blob's end")
        return start, info.file_size


def _extra_chain(extra: bytes, length: int) -> bool:
    """Whether ``extra`` is ``length`` bytes of zip extra-field entries (id, size, data)."""
    if len(extra) != length:
        return False
    at = 0
    while at < length:
        if at + 4 > length:
            return False
        (size,) = struct.unpack_from("<H", extra, at + 2)
        at += 4 + size
    return at == length


def locate_tensor(storage: Storage, path: str, start: int, length: int, *, source: str,
                  ends: BlobEnds | None = None) -> TensorLocation:
    """Where the tensor saved by ``torch.save`` at ``path[start:start+length]`` keeps its bytes.
    Only row-major (contiguous) little-endian tensors are taken; anything else is refused.
    ``ends``: this blob's ends, read already with others of its file."""
    blob = _Blob(storage, path, start, length, source, ends)
    try:
        order = blob.read("byteorder", 16)
    except TorchBlobError:
        order = b"little"  # torch wrote no byteorder record before 1.12: always little-endian there
    if order != b"little":
        raise TorchBlobError(f"{source}: the tensor was saved big-endian ({order!r}); not read")
    ref = safe_loads(blob.read("data.pkl", MAX_PICKLE), _tensor_globals(), source=source,
                     persistent=_persistent(source))
    if not isinstance(ref, _TensorRef) or len(ref.args) < 4 or not isinstance(ref.args[0], _StorageRef):
        raise TorchBlobError(f"{source}: the blob holds {type(ref).__name__}, not one plain tensor")
    st, offset, shape, stride = ref.args[:4]
    if not (type(offset) is int and offset >= 0 and isinstance(shape, tuple) and isinstance(stride, tuple)
            and len(shape) == len(stride) and all(type(v) is int and v >= 0 for v in (*shape, *stride))):
        raise TorchBlobError(f"{source}: malformed tensor header {short(ref.args[1:4], 120)}")
    if ref.version == 3:  # untyped storage (its size in bytes), the dtype an argument
        dtype = ref.args[6] if len(ref.args) >= 7 else None
        if st.dtype != _UNTYPED or not isinstance(dtype, _Dtype) or str(dtype) not in DTYPE_NAMES:
            raise TorchBlobError(f"{source}: malformed tensor header (_rebuild_tensor_v3 of a "
                                 f"{st.dtype} storage, dtype {short(dtype)})")
        dtype = str(dtype)
        storage_bytes = st.numel
    else:
        if st.dtype not in DTYPE_NAMES:
            raise TorchBlobError(f"{source}: storage dtype {short(st.dtype)} is not stored by bytecheckpoint")
        dtype = st.dtype
        storage_bytes = st.numel * _itemsize(dtype)
    numel = math.prod(shape)
    expect, acc = [], 1
    for d in reversed(shape):
        expect.append(acc)
        acc *= d
    expect.reverse()
    if numel and any(s != e for s, e, d in zip(stride, expect, shape) if d > 1):
        raise TorchBlobError(f"{source}: the tensor is stored with strides {stride} for shape {shape} "
                             "(not row-major); load it with torch.distributed.checkpoint instead")
    item = _itemsize(dtype)
    rec_start, rec_size = blob.data_range(blob.record(f"data/{st.key}"))
    if rec_size != storage_bytes or (offset + numel) * item > storage_bytes:
        raise TorchBlobError(f"{source}: the tensor's storage record holds {rec_size} bytes, not the "
                             f"{storage_bytes} its header declares, or the tensor lies outside it")
    return TensorLocation(dtype, tuple(shape), start + rec_start + offset * item, numel * item)


def read_plain_value(storage: Storage, path: str, start: int, length: int, *, source: str) -> Any:
    """The value ``torch.save`` wrote at ``path[start:start+length]``, when it is a plain value
    (None, bool, numbers, str, bytes, and lists/tuples/dicts of them); anything needing a class
    or a tensor to rebuild raises :class:`UnsafePickleError` / :class:`TorchBlobError`."""
    blob = _Blob(storage, path, start, length, source)
    value = safe_loads(blob.read("data.pkl", MAX_PICKLE), plain_globals(), source=source)
    try:
        plain = is_plain(value)
    except PlainValueTooLargeError as exc:
        raise TorchBlobError(f"{source}: {exc}") from None
    if not plain:
        raise TorchBlobError(f"{source}: the value is a {type(value).__name__}, not a plain value")
    return value


def _itemsize(dtype: str) -> int:
    from ..format.dtypes import itemsize
    return itemsize(dtype)
