"""A safe reader of PyTorch DCP's ``.metadata`` file (a pickle of ``dcp.metadata.Metadata``).

The file is unpickled by :mod:`.safe_pickle` with stand-ins for exactly the classes DCP puts
there (``Metadata``, ``TensorStorageMetadata``, ``TensorProperties``, ``ChunkStorageMetadata``,
``BytesStorageMetadata``, ``MetadataIndex``, ``StorageMeta``, ``filesystem._StorageInfo``,
``torch.Size``, dtypes, layouts and paths); anything else is refused by name. The stand-ins'
fields are then checked one by one into :class:`DcpMetadata`: names are strings, dtypes known,
shapes and chunk boxes integers in range, storage files plain names inside the directory,
byte ranges non-negative. Formats: torch 2.x ``torch/distributed/checkpoint/metadata.py`` and
``filesystem.py`` (``CURRENT_DCP_VERSION`` "1.0.0", and the unversioned files before it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from ..format.checks import MAX_BYTES, MAX_NDIM
from ..format.dtypes import DTYPE_NAMES
from .safe_pickle import Record, record_class, safe_loads, short

DCP_METADATA_FILE = ".metadata"
# DCP names its files ``__<rank>_<n>.distcp``; any plain name is accepted, none that climbs out.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,200}$")
_MAX_KEY = 1 << 16
_MD = "torch.distributed.checkpoint.metadata"


class DcpFormatError(CorruptCheckpointError):
    """A DCP checkpoint that cannot be read safely: a malformed ``.metadata``, or a feature
    (stream transforms, another serialization) this reader does not decode."""


@dataclass(frozen=True)
class DcpChunk:
    """One saved chunk of a tensor: its box and where DCP stored it (a ``torch.save`` blob)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    fqn: str
    dtype: str  # a bytecheckpoint dtype name
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


@dataclass(frozen=True)
class DcpBytes:
    """A ``BytesStorageMetadata`` entry: a pickled Python value (``torch.save`` of it)."""

    fqn: str
    file: str
    offset: int
    length: int


@dataclass
class DcpMetadata:
    tensors: dict[str, DcpTensor] = field(default_factory=dict)
    objects: dict[str, DcpBytes] = field(default_factory=dict)
    # The state-dict path of each flattened key (DCP's planner_data), when the saver recorded it.
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    version: str | None = None

    @property
    def files(self) -> set[str]:
        return {c.file for t in self.tensors.values() for c in t.chunks} | {
            b.file for b in self.objects.values()}


class _Token(str):
    """A dtype, layout or enum value named by the pickle (a str, so it compares plainly)."""


def _allowed() -> dict[str, Any]:
    """Fresh stand-ins for one load (see ``safe_pickle.record_class``)."""
    out: dict[str, Any] = {}
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                 "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        out[f"{_MD}.{name}"] = record_class(name)
    # torch 2.0/2.1 kept TensorProperties with sharded tensors.
    out["torch.distributed._shard.sharded_tensor.metadata.TensorProperties"] = out[f"{_MD}.TensorProperties"]
    out["torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING"] = out[
        f"{_MD}._MEM_FORMAT_ENCODING"]
    out["torch.distributed.checkpoint.filesystem._StorageInfo"] = record_class("_StorageInfo")

    def size(*args: Any) -> tuple[Any, ...]:
        return tuple(args[0]) if len(args) == 1 and isinstance(args[0], list | tuple) else ()

    def token(*args: Any) -> _Token:
        return _Token(args[0] if args and isinstance(args[0], str) else "")

    def path(*args: Any) -> str:
        return "/".join(a for a in args if isinstance(a, str))

    out["torch.Size"] = size
    out["torch.serialization._get_layout"] = token
    for layout in ("strided", "sparse_coo", "sparse_csr", "_mkldnn"):
        out[f"torch.{layout}"] = _Token(layout)
    for name in DTYPE_NAMES:
        out[f"torch.{name}"] = _Token(name)
    for cls in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
        out[f"pathlib.{cls}"] = path
    return out


def parse_dcp_metadata(data: bytes, *, source: str) -> DcpMetadata:
    """Decode and check a DCP ``.metadata`` file; never runs code from it."""
    root = safe_loads(data, _allowed(), source=source)
    try:
        return _parse(root, source)
    except (CorruptCheckpointError, UnsafeCheckpointError):
        raise
    except Exception as exc:  # a shape of document the checks did not foresee
        raise DcpFormatError(f"{source}: malformed DCP metadata ({type(exc).__name__}: "
                             f"{short(str(exc), 160)})") from exc


def _bad(source: str, what: str) -> DcpFormatError:
    return DcpFormatError(f"{source}: malformed DCP metadata: {what}; the checkpoint is damaged or "
                          "was not written by torch.distributed.checkpoint")


def _is(value: Any, name: str) -> bool:
    return isinstance(value, Record) and value.qualname == name


def _int(value: Any, source: str, what: str, hi: int = MAX_BYTES) -> int:
    if type(value) is not int or not 0 <= value <= hi:
        raise _bad(source, f"{what} is {_short(value)}, not an integer in 0..{hi}")
    return value


def _ints(value: Any, source: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > MAX_NDIM:
        raise _bad(source, f"{what} is {_short(value)}, not a shape")
    return tuple(_int(v, source, what) for v in value)


def _key(value: Any, source: str) -> str:
    if type(value) is not str or not value or len(value) > _MAX_KEY:
        raise _bad(source, f"key {_short(value)} is not a non-empty string")
    return value


def _file(value: Any, source: str) -> str:
    if type(value) is not str or not _SAFE_NAME.fullmatch(value) or ".." in value:
        raise UnsafeCheckpointError(
            f"{source}: names storage file {_short(value)}, which is not a plain file name inside "
            "the checkpoint directory; refusing to read it (the metadata is corrupt or hostile)")
    return value


def _parse(root: Any, source: str) -> DcpMetadata:
    if not _is(root, "Metadata"):
        raise _bad(source, f"the file holds {_short(root)}, not a DCP Metadata")
    entries = root.field("state_dict_metadata")
    if entries is None and root.args:
        entries = root.args[0]
    if type(entries) is not dict:
        raise _bad(source, "state_dict_metadata is not a dict")
    storage = root.field("storage_data")
    if type(storage) is not dict:
        raise DcpFormatError(
            f"{source}: the DCP metadata has no file locations (storage_data is "
            f"{_short(storage)}): it was written by a storage writer other than the file-system "
            "one, which this reader does not know; load it with torch.distributed.checkpoint")
    where: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for index, info in storage.items():
        if not _is(index, "MetadataIndex") or not _is(info, "_StorageInfo"):
            raise _bad(source, f"storage_data holds {_short(index)}: {_short(info)}")
        fqn = _key(index.field("fqn"), source)
        offset = index.field("offset")
        offset = None if offset is None else _ints(offset, source, f"the chunk offset of {fqn!r}")
        transforms = info.field("transform_descriptors")
        if transforms:
            raise DcpFormatError(
                f"{source}: {fqn!r} is stored through stream transforms {_short(transforms)} "
                "(e.g. compression), which this reader does not decode; load it with "
                "torch.distributed.checkpoint, save it again without them, then convert")
        where[(fqn, offset)] = (_file(info.field("relative_path"), source),
                                _int(info.field("offset"), source, f"the byte offset of {fqn!r}"),
                                _int(info.field("length"), source, f"the byte length of {fqn!r}"))
    out = DcpMetadata()
    version = root.field("version")
    out.version = version if isinstance(version, str) and len(version) < 64 else None
    for fqn, entry in entries.items():
        fqn = _key(fqn, source)
        if _is(entry, "BytesStorageMetadata"):
            loc = where.get((fqn, None))
            if loc is None:
                raise _bad(source, f"{fqn!r} has no stored bytes")
            out.objects[fqn] = DcpBytes(fqn, *loc)
        elif _is(entry, "TensorStorageMetadata"):
            out.tensors[fqn] = _tensor(fqn, entry, where, source)
        else:
            raise _bad(source, f"{fqn!r} is described by {_short(entry)}")
    planner = root.field("planner_data")
    if isinstance(planner, dict):
        for fqn, path in planner.items():
            if fqn in entries and isinstance(path, tuple | list) and 0 < len(path) <= 256 and all(
                    type(p) is str and p or type(p) is int and p >= 0 for p in path):
                out.paths[fqn] = tuple(path)
    return out


def _tensor(fqn: str, entry: Record, where: dict, source: str) -> DcpTensor:
    props = entry.field("properties")
    dtype = props.state[0] if _is(props, "TensorProperties") and isinstance(props.state, tuple) \
        and props.state else (props.field("dtype") if isinstance(props, Record) else None)
    if not isinstance(dtype, _Token) or str(dtype) not in DTYPE_NAMES:
        raise DcpFormatError(f"{source}: {fqn!r} has dtype {_short(dtype)}, which bytecheckpoint "
                             f"does not store (known: {', '.join(sorted(DTYPE_NAMES))})")
    shape = _ints(entry.field("size"), source, f"the shape of {fqn!r}")
    chunks_raw = entry.field("chunks")
    if type(chunks_raw) is not list:
        raise _bad(source, f"the chunks of {fqn!r} are {_short(chunks_raw)}")
    chunks = []
    for c in chunks_raw:
        if not _is(c, "ChunkStorageMetadata"):
            raise _bad(source, f"a chunk of {fqn!r} is {_short(c)}")
        offsets = _ints(c.field("offsets"), source, f"a chunk offset of {fqn!r}")
        sizes = _ints(c.field("sizes"), source, f"a chunk size of {fqn!r}")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise _bad(source, f"a chunk of {fqn!r} has {len(offsets)} dimensions, the tensor {len(shape)}")
        loc = where.get((fqn, offsets))
        if loc is None:
            raise _bad(source, f"the chunk of {fqn!r} at {offsets} has no stored bytes")
        chunks.append(DcpChunk(offsets, sizes, *loc))
    return DcpTensor(fqn, str(dtype), shape, tuple(chunks))


_short = short  # bounded in time and length, whatever the value's size or sharing
