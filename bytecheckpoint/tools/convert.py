"""``bcp convert``: PyTorch DCP directories and ``torch.save`` files to bytecheckpoint, and back.

Into bytecheckpoint (``--from dcp`` / ``--from torch``) the bytes stream: each stored box is
copied block by block (``block`` bytes at most, a multiple of the checksum chunk) from the
source into the checkpoint's storage files, checksummed on the way, then the metadata is
written last and committed exactly as a save commits (save lock, staging, ``latest``).
A DCP source is read through :class:`.dcp_load.DcpStorage`, so its pickled ``.metadata`` is
never unpickled normally; a ``torch.save`` file goes through ``torch.load(weights_only=True,
mmap=True)``, which refuses any class beyond tensors and plain containers.

Back to DCP (``--to dcp``) tensors are loaded whole (the library's resharding load) in batches
into one arena of half the cap (or the largest tensor, if larger), allocated once and reused:
freed and reallocated batches fragment the C heap, which then holds several batches at once
(27 MiB on a 16 MiB cap). Each batch is one ``dcp.save`` into its own file, and the batches'
DCP metadata are merged into one ``.metadata``. The peak is max(cap, largest tensor).
"""

from __future__ import annotations

import os
import pickle
import posixpath
import shutil
import stat
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..commit import save_lock
from ..commit.protocol import abandon, begin_save, commit, data_file_name, update_latest
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from ..format import codec
from ..format.checksums import DEFAULT_CHUNK_BYTES, chunk_checksums
from ..format.metadata import (
    METADATA_FILE,
    BoxTable,
    ByteMeta,
    CheckpointMetadata,
    FileMeta,
    ObjectMeta,
    TensorMeta,
)
from ..storage import Storage, open_storage, split_url
from ..storage.libc import exchange
from .export import ExportError
from .mapped_pages import MappedFile

Progress = Callable[[int], None]
Reader = Callable[[int, int], memoryview]  # (offset inside the entry, length) -> bytes

MIN_MEMORY = 1 << 20


class ConvertError(ExportError):
    """An input a conversion cannot use (a refused pickle, no tensors, a name it cannot map):
    exit code 2 in ``bcp``, as an unusable export/import input."""


@dataclass(frozen=True)
class _Box:
    tensor: int  # index into the tensor list
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    nbytes: int
    read: Reader


@dataclass(frozen=True)
class _Object:
    key: str
    rank: int | None
    nbytes: int
    read: Reader


@dataclass
class ConvertResult:
    path: str
    tensors: int
    bytes: int
    skipped: list[str] = field(default_factory=list)


def _block(max_memory: int) -> tuple[int, int]:
    """(checksum chunk, copy block): a block is a multiple of the chunk and a quarter of the cap."""
    if max_memory < MIN_MEMORY:
        raise ConvertError(f"--max-memory {max_memory}: at least {MIN_MEMORY} bytes (1 MiB)")
    chunk = DEFAULT_CHUNK_BYTES
    while chunk > max_memory // 4 and chunk > 64 << 10:
        chunk //= 2
    block = max(chunk, (max_memory // 4) // chunk * chunk)
    return chunk, block


def _parts(read: Reader, nbytes: int, block: int, progress: Progress | None) -> Iterator[memoryview]:
    for off in range(0, nbytes, block):
        data = read(off, min(block, nbytes - off))
        yield data
        if progress is not None:
            progress(len(data))


def _reader(read: Reader, nbytes: int, block: int,
            progress: Progress | None) -> Callable[[int], Iterator[memoryview]]:
    """A piece's ``parts``: blocks of ``block`` bytes, the converter's memory bound (the writer's
    block is not used)."""
    return lambda _writer_block: _parts(read, nbytes, block, progress)


def _storage_reader(storage: Storage, path: str, base: int, source: str) -> Reader:
    def read(off: int, n: int) -> memoryview:
        buf = bytearray(n)
        got = storage.read_into(path, base + off, memoryview(buf))
        if got != n:
            raise UnsafeCheckpointError(f"{source}: {path} ends {n - got} bytes early (truncated)")
        return memoryview(buf)

    return read


def write_checkpoint(dst: str, tensors: list[TensorMeta], boxes: list[_Box], objects: list[_Object], *,
                     framework: str, layout: dict[str, Any], user_metadata: dict[str, Any],
                     world_size: int = 1, overwrite: bool, max_memory: int, progress: Progress | None = None
                     ) -> CheckpointMetadata:
    """Write and commit a one-writer checkpoint at ``dst`` from entries read on demand.

    ``boxes`` must be sorted by tensor index (the metadata's order). ``world_size`` is the
    saving world the metadata records: per-rank objects exist for each of its ranks."""
    from ..engine.files import Piece, write_file
    from ..format.dtypes import safetensors_code

    chunk, block = _block(max_memory)
    storage, path = open_storage(dst)
    path = path.rstrip("/") or path
    save_id = uuid.uuid4().hex[:12]
    lock = save_lock.acquire(storage, path, save_id)
    try:
        try:
            staging = begin_save(storage, path, overwrite, save_id, lock=lock)
        except CheckpointExistsError:
            raise CheckpointExistsError(f"{dst} already holds a checkpoint (pass --overwrite to replace "
                                        "it)") from None
        try:
            kinds: dict[str, list[tuple[Any, Any]]] = {"model": [], "optim": [], "extra": []}
            for b in boxes:
                key = tensors[b.tensor].key
                kind = "model" if key.split("/", 1)[0] == "model" else "optim"
                name = f"{key}@{','.join(map(str, b.offsets))}"
                code = safetensors_code(tensors[b.tensor].dtype)
                kinds[kind].append((b, Piece(name, code, b.lengths, b.nbytes, None,
                                             parts=_reader(b.read, b.nbytes, block, progress))))
            for o in objects:
                label = f"rank{o.rank}:{o.key}" if o.rank is not None else f"shared:{o.key}"
                kinds["extra"].append((o, Piece(f"__object__/{label}", "U8", (o.nbytes,), o.nbytes, None,
                                                parts=_reader(o.read, o.nbytes, block, progress))))
            files: list[FileMeta] = []
            placed: dict[int, tuple[int, Any]] = {}
            for kind, entries in kinds.items():
                if not entries:
                    continue
                fname = data_file_name(kind, "00000")
                size, written = write_file(storage, storage.join(staging, fname), [p for _, p in entries],
                                           chunk, {"format": "bytecheckpoint", "rank": "0", "kind": kind})
                for (entry, _), w in zip(entries, written):
                    placed[id(entry)] = (len(files), w)
                files.append(FileMeta(fname, size, 0, kind))
            meta = _metadata(tensors, boxes, objects, files, placed, chunk, framework=framework,
                             layout=layout, user_metadata=user_metadata, world_size=world_size)
            raw = meta.to_bytes()
            CheckpointMetadata.from_bytes(raw, source=dst)  # the library's own checks, before commit
            storage.write_bytes(storage.join(staging, METADATA_FILE), raw)
            commit(storage, staging, path, overwrite, save_id)
        except BaseException:
            abandon(storage, staging, path, save_id)
            raise
        update_latest(storage, path, None, save_id)
    finally:
        lock.release()
    return meta


def _metadata(tensors: list[TensorMeta], boxes: list[_Box], objects: list[_Object], files: list[FileMeta],
              placed: dict[int, tuple[int, Any]], chunk: int, **fields: Any) -> CheckpointMetadata:
    i64 = np.int64

    def starts(counts: np.ndarray) -> np.ndarray:
        return (np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(counts) else counts).astype(i64)

    cols = [placed[id(b)] for b in boxes]
    n_chunks = np.array([len(w.checksums) for _, w in cols], dtype=i64)
    ndims = np.array([len(b.offsets) for b in boxes], dtype=i64)
    table = BoxTable(
        tensor=np.array([b.tensor for b in boxes], dtype=np.int32),
        offsets=np.array([o for b in boxes for o in b.offsets], dtype=i64),
        lengths=np.array([n for b in boxes for n in b.lengths], dtype=i64),
        dim_start=starts(ndims),
        file=np.array([f for f, _ in cols], dtype=np.int32),
        byte_offset=np.array([w.byte_offset for _, w in cols], dtype=i64),
        byte_length=np.array([w.byte_length for _, w in cols], dtype=i64),
        checksum_start=starts(n_chunks),
        checksums=np.array([s for _, w in cols for s in w.checksums], dtype=np.uint64),
    )
    objs = []
    for o in objects:
        f, w = placed[id(o)]
        objs.append(ObjectMeta(o.key, o.rank, ByteMeta(files[f].name, w.byte_offset, w.byte_length,
                                                        w.checksums)))
    return CheckpointMetadata(tensors=tensors, boxes=table, objects=objs, files=files, chunk_bytes=chunk,
                              **fields)


# -- DCP -> bytecheckpoint ---------------------------------------------------------------------

def from_dcp(src: str, dst: str, *, max_memory: int, overwrite: bool = False,
             progress: Progress | None = None) -> ConvertResult:
    """Convert the DCP directory ``src`` into a bytecheckpoint checkpoint at ``dst``, streaming."""
    from ..commit.integrity import read_metadata, resolve
    from ..interop.dcp_load import DcpStorage

    _check_apart(src, dst)
    storage, path = resolve(src)
    if not isinstance(storage, DcpStorage):
        raise NotACheckpointError(f"{src} is a bytecheckpoint checkpoint, not a DCP directory (it has "
                                  "metadata.msgpack); convert it with --to dcp, or copy it as it is")
    meta = read_metadata(storage, path)
    boxes = []
    for row in range(len(meta.boxes)):
        t = meta.boxes
        ti = int(t.tensor[row])
        nd = len(meta.tensors[ti].shape)
        start = int(t.dim_start[row])
        fpath = posixpath.join(path, meta.files[int(t.file[row])].name)
        boxes.append(_Box(ti, tuple(int(x) for x in t.offsets[start:start + nd]),
                          tuple(int(x) for x in t.lengths[start:start + nd]), int(t.byte_length[row]),
                          _storage_reader(storage, fpath, int(t.byte_offset[row]), src)))
    objects = [_Object(o.key, o.rank, o.bytes.byte_length,
                       _storage_reader(storage, posixpath.join(path, o.bytes.file), o.bytes.byte_offset, src))
               for o in meta.objects]
    skipped = list(meta.layout.get("skipped", []))
    out = write_checkpoint(dst, list(meta.tensors), boxes, objects, framework="dcp",
                           layout={"source": "dcp", **({"skipped": skipped} if skipped else {})},
                           user_metadata={"converted_from": storage.url(path)}, overwrite=overwrite,
                           world_size=meta.world_size,
                           max_memory=max_memory, progress=progress)
    return ConvertResult(dst, len(out.tensors), out.total_bytes, skipped)


# -- torch.save -> bytecheckpoint --------------------------------------------------------------

def _load_torch(src: str) -> Any:
    import torch

    if split_url(src)[0] != "file":
        raise ConvertError(f"{src}: --from torch reads a local file")
    try:
        return torch.load(src, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        reason = str(exc).split("WeightsUnpickler error:", 1)[-1].strip().splitlines()[0][:300]
        raise ConvertError(
            f"{src}: refused: torch.load(weights_only=True) will not read it ({reason}); it needs the "
            "full unpickler, which can run any code. Load it in trusted code and save its tensors "
            "(torch.save of a dict of tensors), then convert that") from None
    except (RuntimeError, ValueError, EOFError) as exc:
        reason = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        raise ConvertError(f"{src}: not a readable torch.save file ({reason}); convert reads "
                                    "files written by torch.save (the zip format of torch >= 1.6)") from None


def _flatten(value: Any, path: tuple[str, ...], out: list[tuple[tuple[str, ...], Any]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, (*path, str(k)), out)
    else:
        out.append((path, value))


def from_torch(src: str, dst: str, *, max_memory: int, overwrite: bool = False,
               progress: Progress | None = None) -> ConvertResult:
    """Convert a ``torch.save`` state dict into a checkpoint: a flat dict of tensors becomes
    ``model/<name>``; a dict of dicts keeps its top-level keys as groups (``model``,
    ``optimizer``...), deeper levels joined with '/'. Values that are not tensors are named in
    ``skipped``."""
    import torch

    from ..engine.writer import tensor_bytes
    from ..format.dtypes import dtype_name

    _check_apart(src, dst)
    state = _load_torch(src)
    if not isinstance(state, dict):
        raise ConvertError(f"{src} holds a {type(state).__name__}, not a state dict")
    leaves: list[tuple[tuple[str, ...], Any]] = []
    _flatten(state, (), leaves)
    if any(len(p) == 1 and isinstance(v, torch.Tensor) for p, v in leaves):
        leaves = [(("model", *p), v) for p, v in leaves]  # a bare model state dict
    named: dict[str, torch.Tensor] = {}
    skipped = []
    for p, v in leaves:
        if not isinstance(v, torch.Tensor) or len(p) < 2:
            skipped.append(f"{'.'.join(p)} (a {type(v).__name__}, not a tensor)")
            continue
        key = f"{p[0]}/{'/'.join(p[1:])}" if p[0] != "model" else f"model/{'.'.join(p[1:])}"
        if any(not part or "/" in part for part in p):
            skipped.append(f"{'.'.join(p)} (an empty name or one with '/', bytecheckpoint's separator)")
            continue
        if key in named:
            raise ConvertError(f"{src}: two entries map to the key {key!r}")
        try:
            dtype_name(v.dtype)
        except CheckpointError as exc:
            raise ConvertError(f"{src}: {'.'.join(p)}: {exc}") from None
        if v.is_sparse or v.layout != torch.strided:
            raise ConvertError(f"{src}: {'.'.join(p)} is a {v.layout} tensor; only dense tensors convert")
        named[key] = v
    if not named:
        raise ConvertError(f"{src} holds no tensors to convert")
    tensors = [TensorMeta(k, dtype_name(named[k].dtype), tuple(named[k].shape)) for k in sorted(named)]

    mapped = MappedFile(src)  # torch.load mapped the file: its copied pages are let go
    last: dict[int, memoryview] = {}  # one tensor's bytes: a strided tensor is made contiguous once
    done: list[tuple[torch.Tensor, int, int]] = []  # the last piece handed out, copied by now

    def reader(t: torch.Tensor) -> Reader:
        def read(off: int, n: int) -> memoryview:
            for held, lo, size in done:
                if held.is_contiguous():
                    mapped.drop(held.data_ptr() + lo, size)
                elif id(held) != id(t):  # a strided tensor's source pages, once it is done
                    storage = held.untyped_storage()
                    mapped.drop(storage.data_ptr(), storage.nbytes())
            done.clear()
            if id(t) not in last:
                last.clear()
                last[id(t)] = tensor_bytes(t)  # a view of the mapped file when contiguous
            done.append((t, off, n))
            return last[id(t)][off:off + n]

        return read

    boxes = [_Box(i, (0,) * len(tm.shape), tm.shape, named[tm.key].numel() * named[tm.key].element_size(),
                  reader(named[tm.key])) for i, tm in enumerate(tensors)]
    layout: dict[str, Any] = {"source": "torch.save", **({"skipped": skipped} if skipped else {})}
    out = write_checkpoint(dst, tensors, boxes, [], framework="torch", layout=layout,
                           user_metadata={"converted_from": os.path.abspath(src)},
                           overwrite=overwrite, max_memory=max_memory, progress=progress)
    last.clear()
    return ConvertResult(dst, len(out.tensors), out.total_bytes, skipped)


# -- bytecheckpoint -> DCP ---------------------------------------------------------------------

def _nest(state: dict[str, Any], key: str, value: Any) -> None:
    top, _, rest = key.partition("/")
    node = state.setdefault(top, {})
    if top == "model" or not rest:
        if rest:
            node[rest] = value
        else:
            state[top] = value
        return
    parts = rest.split("/")
    if parts[0] == "state" and len(parts) >= 3:  # optimizer state: state/<fqn>/<name>
        node.setdefault("state", {}).setdefault("/".join(parts[1:-1]), {})[parts[-1]] = value
        return
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _param_groups(per_fqn: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``get_state_dict``'s param_groups from bytecheckpoint's per-parameter hyperparameters:
    parameters with equal hyperparameters form one group, in first-seen order."""
    groups: list[dict[str, Any]] = []
    for fqn, hp in per_fqn.items():
        for g in groups:
            if {k: v for k, v in g.items() if k != "params"} == hp:
                g["params"].append(fqn)
                break
        else:
            groups.append({**hp, "params": [fqn]})
    return groups


def _check_apart(src: str, dst: str) -> None:
    """DST must not be SRC, inside it or around it: writing or replacing it would change SRC."""
    (s_scheme, s_path), (d_scheme, d_path) = split_url(src), split_url(dst)
    if s_scheme != "file" or d_scheme != "file":
        return
    a, b = os.path.realpath(s_path), os.path.realpath(d_path)
    if os.path.commonpath([a, b]) in (a, b):
        raise ConvertError(f"DST {dst} {'is' if a == b else 'overlaps'} SRC {src}: choose a path "
                                   "outside it")


def _check_dst_dir(dst: str, overwrite: bool) -> str:
    """The local path of ``--to dcp``'s DST, refused unless it is absent, an empty directory or
    (with ``overwrite``) a checkpoint with nothing else in it: replacing it deletes it whole."""
    scheme, local = split_url(dst)
    if scheme != "file":
        raise ConvertError(f"{dst}: --to dcp writes a local directory (DCP's FileSystemWriter)")
    local = os.path.abspath(local)
    if os.path.lexists(local):
        _check_replaceable(dst, local, overwrite)
    return local


def _check_replaceable(dst: str, local: str, overwrite: bool) -> None:
    """Raise unless ``local`` is an empty directory or a checkpoint that ``overwrite`` may
    replace: a DCP checkpoint (``.metadata`` and ``*.distcp`` files) or a bytecheckpoint one (the
    files its metadata names, as ``save(overwrite=True)`` decides), with nothing else in it."""
    from ..commit.protocol import checkpoint_files
    from ..interop.dcp_metadata import DCP_METADATA_FILE

    if os.path.islink(local) or not os.path.isdir(local):
        what = "a symbolic link" if os.path.islink(local) else "not a directory"
        raise NotACheckpointError(f"{dst} exists and is {what}, not a checkpoint; convert refuses to "
                                  "replace it: choose another DST")
    names = os.listdir(local)
    if not names:
        if not overwrite:
            raise CheckpointExistsError(f"{dst} already exists (pass --overwrite to replace it)")
        return
    allowed: set[str] = set()
    if DCP_METADATA_FILE in names:
        allowed |= {DCP_METADATA_FILE, *(n for n in names if n.endswith(".distcp"))}
    if METADATA_FILE in names:
        storage, path = open_storage(local)
        allowed |= checkpoint_files(storage, path) or set()  # NotACheckpointError: not ours
    if not allowed:
        raise NotACheckpointError(f"{dst} exists and is not a checkpoint; convert refuses to replace "
                                  "it: choose another DST")
    if not overwrite:
        raise CheckpointExistsError(f"{dst} already exists (pass --overwrite to replace it)")
    extra = sorted(n for n in names if n not in allowed or not _plain_file(os.path.join(local, n)))
    if extra:
        shown = ", ".join(repr(n) for n in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5
                                                         else "")
        raise NotACheckpointError(
            f"{dst} holds a checkpoint and also {shown}, which are not part of it; --overwrite "
            "replaces only a checkpoint with nothing else in it (the whole directory is replaced), "
            "so nothing was changed. Move those out, or choose another DST")


def _plain_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _replace_dir(tmp: str, local: str, dst: str, overwrite: bool) -> None:
    """Move the finished ``tmp`` to ``local``. An old DST is checked again (files may have
    been added meanwhile), then swapped with the new one in one step where the file system
    can (``renameat2``), so DST always holds the old or the new checkpoint; elsewhere it is
    renamed aside and the new one renamed in, and a crash between the two leaves both beside
    DST (``DST.replaced-*`` the old one, ``DST.convert-*`` the new one). The old one is then
    deleted."""
    if not os.path.lexists(local):
        os.rename(tmp, local)  # fails, rather than replacing, should a DST appear meanwhile
        return
    _check_replaceable(dst, local, overwrite)
    if exchange(tmp, local):
        shutil.rmtree(tmp, ignore_errors=True)  # the old DST, now at the temporary name
        return
    aside = f"{local}.replaced-{uuid.uuid4().hex[:8]}"
    os.rename(local, aside)
    try:
        os.rename(tmp, local)
    except BaseException:
        os.rename(aside, local)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def to_dcp(src: str, dst: str, *, max_memory: int, overwrite: bool = False,
           progress: Progress | None = None) -> ConvertResult:
    """Write the checkpoint ``src`` as a DCP directory ``dst`` that ``dcp.load`` reads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import Metadata

    from ..commit.integrity import read_metadata, resolve
    _block(max_memory)
    _check_apart(src, dst)
    local = _check_dst_dir(dst, overwrite)
    storage, path = resolve(src)
    meta = read_metadata(storage, path)
    url = storage.url(path)
    sizes = [_aligned(tm.nbytes) for tm in meta.tensors]
    arena = _Arena(max(min(max_memory // 2, sum(sizes)), max(sizes, default=0)))  # the largest fits
    batches: list[list[TensorMeta]] = [[]]
    size = 0
    for tm in meta.tensors:
        if batches[-1] and size + _aligned(tm.nbytes) > arena.size:
            batches.append([])
            size = 0
        batches[-1].append(tm)
        size += _aligned(tm.nbytes)
    tail: dict[str, Any] = {}
    skipped = [f"dataloader state ({len(meta.loader)} entries): DCP has no place for it"] * bool(meta.loader)
    per_fqn: dict[str, dict[str, dict[str, Any]]] = {}
    for o in meta.objects:
        if o.rank not in (None, 0):  # per-rank state: rank 0's copy stands for a one-process save
            skipped.append(f"{o.key} of rank {o.rank} (rank 0's copy kept)")
            continue
        data = _storage_reader(storage, posixpath.join(path, o.bytes.file), o.bytes.byte_offset, url)(
            0, o.bytes.byte_length)
        if getattr(storage, "checksummed", True) and tuple(
                chunk_checksums(data, meta.chunk_bytes)) != tuple(o.bytes.checksums):
            raise CorruptCheckpointError(f"{url}: the bytes of object {o.key!r} in {o.bytes.file} do not "
                                         "match their checksum")
        value = codec.decode(bytes(data))
        top, _, rest = o.key.partition("/")
        if rest.startswith("param_groups/"):
            per_fqn.setdefault(top, {})[rest[len("param_groups/"):]] = value
        else:
            _nest(tail, o.key, value)
    for top, hp in per_fqn.items():
        tail.setdefault(top, {})["param_groups"] = _param_groups(hp)

    tmp = f"{local}.convert-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        merged: Metadata | None = None
        for i, batch in enumerate(batches):
            state: dict[str, Any] = {}
            for key, t in _load_into(url, batch, arena).items():
                _nest(state, key, t)
            if i == len(batches) - 1:
                _merge_into(state, tail)
            sub = os.path.join(tmp, f"batch{i}")
            writer = FileSystemWriter(sub, single_file_per_rank=True)
            with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
                warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                md = dcp.save(state, storage_writer=writer, no_dist=True)
            merged = _merge(merged, md, sub, tmp, i)
            shutil.rmtree(sub)
            if progress is not None:
                progress(sum(tm.nbytes for tm in batch))
            del state
        with open(os.path.join(tmp, ".metadata.tmp"), "wb") as f:
            pickle.dump(merged, f)  # written by us, of torch's own classes: what dcp.load reads
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(tmp, ".metadata.tmp"), os.path.join(tmp, ".metadata"))
        _replace_dir(tmp, local, dst, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConvertResult(local, len(meta.tensors), meta.total_bytes, skipped)


def _aligned(n: int) -> int:
    return -(-n // 64) * 64


class _Arena:
    """One buffer the batches of ``--to dcp`` take turns in. Each tensor is a ``frombuffer``
    view whose storage is exactly its own bytes, so ``dcp.save`` writes it without a copy
    (DCP clones a tensor whose storage is larger than the tensor)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.buffer = memoryview(bytearray(size)) if size else None

    def tensors(self, metas: list[TensorMeta]) -> dict[str, Any]:
        import torch

        from ..format.dtypes import dtype_from_name

        out: dict[str, Any] = {}
        offset = 0
        for tm in metas:
            dtype = dtype_from_name(tm.dtype)
            if tm.nbytes == 0 or self.buffer is None:
                out[tm.key] = torch.empty(tm.shape, dtype=dtype)
                continue
            count = tm.nbytes // dtype.itemsize
            flat = torch.frombuffer(self.buffer, dtype=dtype, count=count, offset=offset)
            out[tm.key] = flat.view(tm.shape)
            offset += _aligned(tm.nbytes)
        return out


def _load_into(url: str, batch: list[TensorMeta], arena: _Arena) -> dict[str, Any]:
    """Full tensors of ``batch`` in the arena, through the library's resharding load."""
    from ..api import load
    from ..state.tensor_shard import TensorShard

    out = arena.tensors(batch)
    targets: dict[str, dict[str, TensorShard]] = {}
    for tm in batch:
        group, rest = tm.key.split("/", 1)
        targets.setdefault(group, {})[rest] = TensorShard(out[tm.key], tuple(tm.shape))
    load(url, targets, framework="manual", strict=False)
    return out


def _merge_into(state: dict[str, Any], extra: dict[str, Any]) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(state.get(k), dict):
            _merge_into(state[k], v)
        else:
            state[k] = v


def _merge(merged: Any, md: Any, sub: str, root: str, batch: int) -> Any:
    """Move one batch's files into ``root`` (renamed ``__0_<batch>_<name>``) and fold its DCP
    metadata into ``merged``: storage_data points at the renamed files."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    renamed = {}
    for name in os.listdir(sub):
        if name.endswith(".distcp"):
            new = f"__0_{batch}_{name.lstrip('_')}"
            os.replace(os.path.join(sub, name), os.path.join(root, new))
            renamed[name] = new
    storage_data = {idx: _StorageInfo(renamed[info.relative_path], info.offset, info.length,
                                      getattr(info, "transform_descriptors", None))
                    for idx, info in md.storage_data.items()}
    if merged is None:
        md.storage_data = storage_data
        md.storage_meta = None
        return md
    merged.state_dict_metadata.update(md.state_dict_metadata)
    merged.storage_data.update(storage_data)
    if md.planner_data:
        merged.planner_data = {**(merged.planner_data or {}), **md.planner_data}
    return merged
