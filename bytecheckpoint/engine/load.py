"""The load workflow, run by every rank; resharding happens here.

  1. resolve + metadata   find the committed checkpoint, read and validate its metadata
  2. match                flatten the target state; check keys, shapes and dtypes
  3. plan reads           intersect each target box with the saved boxes of its tensor
  4. read + copy          one ranged read per saved box needed (widened to whole checksum
                          chunks and verified), then copy each intersection in place
  5. apply                optimizer param groups, module extra state, other objects
A final collective makes every rank raise if any rank failed.
"""

from __future__ import annotations

import posixpath
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from telemetry import span

from .. import codec
from ..checksums import bad_chunks, widen_to_chunks
from ..comm import Communicator, Outcome, raise_failures
from ..dtypes import dtype_from_name, dtype_name
from ..errors import (
    CorruptCheckpointError,
    DtypeMismatchError,
    MissingKeysError,
    ShapeMismatchError,
    StateMismatchError,
)
from ..integrity import check_file_sizes, read_metadata, resolve
from ..leases import lease_for_load
from ..metadata import CheckpointMetadata, SavedBox
from ..planners import LocalShard, get_planner
from ..sharding import Box, element_span, row_major_strides
from ..state import FlatState, flatten_state
from ..storage import Storage

_MAX_LISTED = 20


@dataclass
class LoadResult:
    path: str
    step: int | None
    framework: str  # of the checkpoint
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    bytes_read: int = 0  # by this rank
    duration_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class _Copy:
    region: Box  # global coordinates, inside both the saved box and the target shard
    target: LocalShard


def _listing(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED])
    return shown + (f" ... and {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else "")


def _match_keys(meta: CheckpointMetadata, flat: FlatState,
                everyone: list[tuple[set[str], set[str], list[str]]]) -> tuple[list[str], list[str]]:
    """Missing keys (this rank's) and unexpected keys (wanted by no rank), within the
    top-level groups the state asks for.

    Groups absent from the state are ignored, so ``{"model": m}`` loads just the model of a
    checkpoint that also holds an optimizer. ``everyone`` holds every rank's wanted keys and
    groups: a pipeline stage does not ask for another stage's layers, yet they are expected.
    """
    saved = {t.key for t in meta.tensors} | {o.key for o in meta.objects}
    missing = sorted(_wanted(flat) - saved)
    wanted_anywhere = set().union(*(w for w, _, _ in everyone))
    groups = set().union(*(g for _, g, _ in everyone))
    accepted = tuple(sorted({p for _, _, prefixes in everyone for p in prefixes}))
    unexpected = sorted(
        k for k in saved - wanted_anywhere
        if k.split("/", 1)[0] in groups and not k.startswith(accepted)
    )
    return missing, unexpected


def _check_splittable(meta: CheckpointMetadata, flat: FlatState, world_size: int) -> None:
    """A stateful object saved per rank (a data loader's position, say) cannot be handed to
    another number of ranks unless every rank saved the same state (e.g. an LR scheduler)."""
    for key in sorted(flat.per_rank_stateful):
        copies = {(o.bytes.byte_length, tuple(o.bytes.checksums)) for o in meta.objects
                  if o.key == key and o.rank is not None}
        if len(copies) > 1:
            raise StateMismatchError(
                f"state[{key!r}] was saved per rank by {meta.world_size} ranks with different "
                f"values and cannot be split over {world_size} ranks: it does not know how to "
                "reshard. Use a loader that does (bytecheckpoint.data.TokenLoader), or leave "
                f"{key!r} out of the state and rebuild it"
            )


def _wanted(flat: FlatState) -> set[str]:
    return set(flat.tensors) | set(flat.shared_objects) | set(flat.rank_objects)


def _accepted(flat: FlatState, key: str) -> bool:
    return any(key.startswith(p) for p in flat.accept_prefixes)


def _check_tensor(key: str, tensor: torch.Tensor, saved_shape: tuple[int, ...], saved_dtype: str,
                  global_shape: tuple[int, ...]) -> None:
    if tuple(global_shape) != tuple(saved_shape):
        raise ShapeMismatchError(
            f"{key}: shape mismatch: the checkpoint has {tuple(saved_shape)}, the state to load "
            f"into has {tuple(global_shape)}"
        )
    if tensor.dtype != dtype_from_name(saved_dtype):
        raise DtypeMismatchError(
            f"{key}: dtype mismatch: the checkpoint has {saved_dtype}, the state to load into "
            f"has {dtype_name(tensor.dtype)}; cast the model before loading or save in this dtype"
        )


def _read_box(storage: Storage, path: str, meta: CheckpointMetadata, saved: SavedBox,
              copies: list[_Copy], verify: bool) -> int:
    """Read the part of one saved box that ``copies`` need, verify it, copy it out."""
    dtype = dtype_from_name(meta.tensor(saved.key).dtype)
    item = dtype.itemsize
    lo, hi = None, 0
    for c in copies:
        first, end = element_span(c.region.relative_to(saved.box), saved.box.lengths)
        lo = first if lo is None else min(lo, first)
        hi = max(hi, end)
    start, stop = lo * item, hi * item
    if verify:
        start, stop = widen_to_chunks(start, stop, saved.bytes.byte_length, meta.chunk_bytes)
    full = posixpath.join(path, saved.bytes.file)
    buf = bytearray(stop - start)
    with span("load.read", path=full, bytes=len(buf)):
        got = storage.read_into(full, saved.bytes.byte_offset + start, memoryview(buf))
    if got != len(buf):
        raise CorruptCheckpointError(
            f"{storage.url(full)}: truncated: wanted {len(buf)} bytes at "
            f"{saved.bytes.byte_offset + start}, got {got}"
        )
    if verify:
        bad = bad_chunks(memoryview(buf), start, list(saved.bytes.checksums), meta.chunk_bytes)
        if bad:
            raise CorruptCheckpointError(
                f"{storage.url(full)}: checksum mismatch in {saved.key} (bytes "
                f"{saved.bytes.byte_offset + start}..{saved.bytes.byte_offset + stop}); the file "
                "is corrupt: restore it or load another checkpoint"
            )
    flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    values = flat.view(dtype) if flat.numel() else torch.empty(0, dtype=dtype)
    base = start // item
    strides = row_major_strides(saved.box.lengths)
    for c in copies:
        rel = c.region.relative_to(saved.box)
        first, _ = element_span(rel, saved.box.lengths)
        src = values.as_strided(rel.lengths, strides, first - base)
        dst = c.target.data[c.region.relative_to(c.target.box).slices()]
        dst.copy_(src)
    return len(buf)


def load(
    url: str,
    state: dict[str, Any],
    *,
    framework: str | None = None,
    strict: bool = True,
    process_group: Any = None,
    verify: bool = True,
    threads: int = 4,
    fqn_map: Callable[[str], str] | None = None,
) -> LoadResult:
    t0 = time.perf_counter()
    comm = Communicator(process_group)
    phases: dict[str, float] = {}
    error: BaseException | None = None
    result: LoadResult | None = None
    # The read lease tells a tiering service not to move this checkpoint while it is read.
    with span("load", path=url) as total, lease_for_load(url):
        try:
            result = _load_local(url, state, framework, strict, comm, verify, threads, phases,
                                 fqn_map)
        except Exception as exc:
            error = exc
        with span("load.barrier"):
            comm.check_all(error, "checkpoint load")
        assert result is not None
        result.duration_s = time.perf_counter() - t0
        result.phases = phases
        total.set(bytes=result.bytes_read)
    return result


def _load_local(url: str, state: dict[str, Any], framework: str | None, strict: bool,
                comm: Communicator, verify: bool, threads: int, phases: dict[str, float],
                fqn_map: Callable[[str], str] | None) -> LoadResult:
    t = time.perf_counter()
    local_error: BaseException | None = None
    try:
        with span("load.metadata"):
            storage, path = resolve(url)
            meta = read_metadata(storage, path)
        phases["metadata"] = time.perf_counter() - t
        t = time.perf_counter()
        saved_keys = {tm.key for tm in meta.tensors} | {o.key for o in meta.objects}
        flat = flatten_state(
            state, for_load=True, fqn_map=fqn_map,
            has_saved_state=lambda prefix: any(k.startswith(prefix) for k in saved_keys),
        )
        planner = get_planner(framework, flat, comm)
        mine = Outcome(value=(_wanted(flat), set(flat.kinds), list(flat.accept_prefixes)))
    except Exception as exc:
        local_error, mine = exc, Outcome.failure(exc)
    # The one collective before reading: every rank's keys (and any early failure).
    everyone = comm.all_gather(mine)
    raise_failures(everyone, "checkpoint load", local_error)

    with span("load.plan"):
        missing, unexpected = _match_keys(meta, flat, [o.value for o in everyone])
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append(f"missing from the checkpoint: {_listing(missing)}")
            if unexpected:
                parts.append(f"in the checkpoint but not in the state: {_listing(unexpected)}")
            raise MissingKeysError(
                f"{storage.url(path)}: state and checkpoint keys differ; " + "; ".join(parts)
                + ". Pass strict=False to load the keys they share", missing, unexpected,
            )
        problems: list[StateMismatchError] = []
        reads: dict[SavedBox, list[_Copy]] = defaultdict(list)
        for key, tensor in flat.tensors.items():
            tm = meta.tensor(key)
            if tm is None:
                continue
            try:
                _check_tensor(key, tensor, tm.shape, tm.dtype, planner.global_shape(tensor))
            except StateMismatchError as exc:
                problems.append(exc)
                continue
            targets = planner.pieces(key, tensor)
            for saved in meta.boxes_of(key):
                for target in targets:
                    region = saved.box.intersect(target.box)
                    if region is not None and not region.is_empty():
                        reads[saved].append(_Copy(region, target))
        if problems:
            if len(problems) == 1:
                raise problems[0]
            raise type(problems[0])("; ".join(str(p) for p in problems[:_MAX_LISTED]))
        check_file_sizes(storage, path, meta, {s.bytes.file for s in reads}
                         | {o.bytes.file for o in meta.objects})
    phases["plan"] = time.perf_counter() - t

    t = time.perf_counter()
    # Per file, in byte order: sequential-ish reads, spread over a few threads.
    ordered = sorted(reads.items(), key=lambda kv: (kv[0].bytes.file, kv[0].bytes.byte_offset))
    with ThreadPoolExecutor(max(1, threads)) as pool:
        sizes = list(pool.map(lambda kv: _read_box(storage, path, meta, kv[0], kv[1], verify), ordered))
    bytes_read = sum(sizes)
    phases["read"] = time.perf_counter() - t

    t = time.perf_counter()
    with span("load.apply"):
        shared: dict[str, Any] = {}
        ranked: dict[str, Any] = {}
        # Per-rank objects come from the same rank when the world is unchanged, else from
        # rank 0 (replicated values such as counters stay right; see README).
        source_rank = comm.rank if meta.world_size == comm.world_size else 0
        if meta.world_size != comm.world_size:
            _check_splittable(meta, flat, comm.world_size)
        for obj in meta.objects:
            if obj.rank is None:
                wanted = obj.key in flat.shared_objects or _accepted(flat, obj.key)
            else:
                wanted = obj.key in flat.rank_objects
            if not wanted or (obj.rank is not None and obj.rank != source_rank):
                continue
            full = posixpath.join(path, obj.bytes.file)
            data = storage.read(full, obj.bytes.byte_offset, obj.bytes.byte_length)
            bytes_read += len(data)
            if verify and bad_chunks(memoryview(data), 0, list(obj.bytes.checksums), meta.chunk_bytes):
                raise CorruptCheckpointError(
                    f"{storage.url(full)}: checksum mismatch in stored object {obj.key!r}; the "
                    "file is corrupt"
                )
            (shared if obj.rank is None else ranked)[obj.key] = codec.decode(bytes(data))
        for apply in flat.appliers:
            apply(shared, ranked)
    phases["apply"] = time.perf_counter() - t
    return LoadResult(storage.url(path), meta.step, meta.framework, missing, unexpected, bytes_read)
