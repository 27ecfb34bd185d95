"""The load workflow, run by every rank; resharding happens here.

  1. resolve + metadata   find the committed checkpoint, read and validate its metadata
  2. match                flatten the target state; check keys, shapes and dtypes
  3. plan reads           intersect each target box with the saved boxes of its tensor; the
                          byte range needed of each (widened to whole checksum chunks)
  early                   reads of the boxes this rank is certain to read (what it needs of the
                          files it is the preferred reader of: ``read_plan.preferred_readers``)
                          and the file size/header check start here, in the background
  4. agree                one all-gather of every rank's keys and byte ranges; every rank
                          derives the same read plan: each needed byte read by one rank
  5. read + exchange      ranged, verified reads on a thread pool; units other ranks need are
                          sent to them; each finished box is copied in place (load_pipeline)
  6. apply                optimizer param groups, module extra state, other objects
A final collective makes every rank raise if any rank failed.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any

import torch

from telemetry import PENDING_STEP, scope_step, span

from ..commit.integrity import check_file_sizes, metadata_identity, read_metadata_identified, resolve
from ..commit.leases import lease_for_load
from ..errors import (
    CheckpointReplacedError,
    CorruptCheckpointError,
    DtypeMismatchError,
    InvalidSettingError,
    MissingKeysError,
    ProcessGroupError,
    RankFailedError,
    ShapeMismatchError,
    StateMismatchError,
)
from ..format import codec
from ..format.boxes import element_span
from ..format.checksums import widen_to_chunks
from ..format.dtypes import dtype_from_name, dtype_name
from ..format.metadata import CheckpointMetadata, SavedBox
from ..planners import get_planner
from ..runtime.comm import Communicator, Outcome, raise_failures
from ..runtime.devices import exchange_device
from ..runtime.gc_pause import gc_paused
from ..runtime.identity import stamp_rank, stamp_topology, state_tensors
from ..state.flatten import FlatState, flatten_state
from ..state.tensor_shard import ShardSet, TensorShard
from ..storage import Storage
from .coverage import add_read, check_coverage, check_shared_objects
from .load_pipeline import BoxRead, Copy, LoadPipeline, Prefetch, direct_target
from .read_plan import Need, plan_reads, preferred_readers
from .transport import choose as choose_transport

_MAX_LISTED = 20
# Reader threads shared by the ranks of one host. Every rank reading with several threads,
# each split again into parts by the storage layer, puts dozens of streams on one disk: with
# 4 ranks on a host, 1 thread each loaded a 3.6 GB checkpoint in 1.97 s and 4 each in 2.64 s
# (medians of 3, bench/engine_vs_dcp.py's workload).
READ_THREADS_PER_HOST = 4


def read_threads_setting() -> int | None:
    """``BCP_LOAD_THREADS``, checked; None when unset."""
    raw = os.environ.get("BCP_LOAD_THREADS", "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidSettingError(f"BCP_LOAD_THREADS = {raw!r} is not a positive integer: unset it or "
                                  "give the reader threads per rank")
    return value


def early_setting() -> bool:
    """``BCP_LOAD_EARLY``: "0" turns off the work a load starts before its plan is agreed
    (reads of certain boxes, the file check in the background); the benchmark's baseline."""
    raw = os.environ.get("BCP_LOAD_EARLY", "").strip().lower()
    if raw in ("", "1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise InvalidSettingError(f"BCP_LOAD_EARLY = {raw!r}: use 1 (the default: start reading before "
                              "the plan is agreed) or 0 (read nothing before it), or unset it")


def share_of_host(ranks_on_host: int, cores: int | None = None) -> int:
    """This rank's share of the host's reader threads (at least one), and no more than its
    share of the cores: a reader thread also copies out of the page cache and checks
    checksums, and one without a core of its own only adds a stream to the disk. With 2
    ranks on 2 cores, 1 thread each loaded 3.56 GB resharded 4 -> 2 in 2.07 s and 2 each in
    2.36 s (bench/load_vs_read_limit.py, medians of 3)."""
    ranks = max(1, ranks_on_host)
    cores = usable_cores() if cores is None else cores
    return max(1, min(READ_THREADS_PER_HOST // ranks, cores // ranks))


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


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
    transport: str = "gloo"  # how the ranks exchanged units: "nccl" or "gloo", the same on every rank
    # Entries of the checkpoint's source that could not be mapped, each "name (why)": DCP
    # values that are no plain value, or what ``bcp convert`` left out.
    skipped: list[str] = field(default_factory=list)


def _listing(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED])
    return shown + (f" ... and {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else "")


def _check_splittable(meta: CheckpointMetadata, flat: FlatState, world_size: int) -> None:
    """A stateful object saved per rank (a data loader's position, say) cannot be handed to
    another number of ranks unless every rank saved the same state (e.g. an LR scheduler)."""
    for key in sorted(flat.rank_sharded):  # the same position means other samples there
        if any(o.key == key and o.rank is not None for o in meta.objects):
            raise StateMismatchError(
                f"state[{key!r}] is a data loader over a DistributedSampler, saved by "
                f"{meta.world_size} ranks: its position counts batches of each rank's part of the "
                f"data, which {world_size} ranks split differently, so it would read samples again "
                f"or skip some. Leave {key!r} out of the state to start its epoch over, or use a "
                "loader that reshards (bytecheckpoint.data.TokenLoader)"
            )
    differing = []
    for key in sorted(flat.rank_objects):
        copies = {(o.bytes.byte_length, tuple(o.bytes.checksums)) for o in meta.objects
                  if o.key == key and o.rank is not None}
        if len(copies) > 1 and key not in flat.per_rank_stateful:
            differing.append(key)
        elif len(copies) > 1:
            raise StateMismatchError(
                f"state[{key!r}] was saved per rank by {meta.world_size} ranks with different "
                f"values and cannot be split over {world_size} ranks: it does not know how to "
                "reshard. Use a loader that does (bytecheckpoint.data.TokenLoader), or leave "
                f"{key!r} out of the state and rebuild it"
            )
    if differing:
        # Documented (docs/format.md), but a per-rank value such as a numpy RNG state that
        # every rank now shares changes training, so it is said out loud.
        warnings.warn(
            f"state entries {differing} were saved per rank with different values by "
            f"{meta.world_size} ranks; loaded into {world_size} ranks, every rank gets rank 0's "
            "value. Keep random generators in bytecheckpoint.RNGState(), which reseeds each new "
            "rank, and rebuild other per-rank values after the load", RuntimeWarning, stacklevel=2)


def _wanted(flat: FlatState) -> set[str]:
    return set(flat.tensors) | set(flat.shared_objects) | set(flat.rank_objects) | flat.absent


def _accepted(prefixes: list[str], key: str) -> bool:
    return any(key.startswith(p) for p in prefixes)


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


def load(
    url: str,
    state: dict[str, Any],
    *,
    framework: str | None = None,
    strict: bool = True,
    process_group: Any = None,
    verify: bool = True,
    threads: int | None = None,
    fqn_map: Callable[[str], str] | None = None,
) -> LoadResult:
    t0 = time.perf_counter()
    comm = Communicator(process_group)
    stamp_rank()
    # The first few tensors only: a DTensor state shows one at once, and walking a large
    # plain model's every parameter cost ~1 us each, every call (flattening stamps it later).
    stamp_topology(itertools.islice(state_tensors(state), 16))
    phases: dict[str, float] = {}
    error: BaseException | None = None
    result: LoadResult | None = None
    # The read lease tells a tiering service not to move this checkpoint while it is read.
    # The step is the checkpoint's, known once its metadata is read (not training's last step).
    with span("load", path=url, step=PENDING_STEP) as total, lease_for_load(url), gc_paused():
        try:
            result = _load_local(url, state, framework, strict, comm, verify, threads, phases,
                                 fqn_map, process_group)
        except BaseException as exc:  # a KeyboardInterrupt too: told to the others, then raised
            error = exc
        if isinstance(error, ProcessGroupError):
            raise error  # the group is broken: another collective fails or waits out its timeout
        with span("load.barrier"):
            comm.check_all(error, "checkpoint load")
        assert result is not None
        result.duration_s = time.perf_counter() - t0
        result.phases = phases
        total.set(bytes=result.bytes_read)
    return result




@dataclass
class _LocalPlan:
    """What this rank wants from the checkpoint, worked out before any communication."""

    storage: Storage
    path: str
    meta: CheckpointMetadata
    flat: FlatState
    reads: dict[tuple[int, int], BoxRead]  # by (file index, byte offset) of the saved piece
    needs: list[Need]
    problems: list[StateMismatchError]
    identity: bytes = b""  # digest of the metadata this load started from
    verify: bool = True  # False where the checkpoint stores no checksums (a DCP directory)
    sharing: dict[str, str] = field(default_factory=dict)  # keys sharing memory (_sharing_memory)


def _check_unchanged(storage: Storage, path: str, identity: bytes,
                     error: BaseException | None = None) -> None:
    """Raise CheckpointReplacedError if the metadata at ``path`` is no longer the one the load
    started from: an ``overwrite=True`` save replaced the checkpoint meanwhile, so what was read
    may mix two saves (and a read error is the swap's doing, not damage)."""
    if metadata_identity(storage, path) == identity:
        return
    raise CheckpointReplacedError(
        f"{storage.url(path)}: the checkpoint was replaced (overwritten by another save) while "
        "it was being loaded, so the bytes read may come from two saves; load again"
    ) from error


def _needed_range(saved: SavedBox, copies: list[Copy], item: int, verify: bool,
                  chunk_bytes: int) -> tuple[int, int]:
    lo, hi = None, 0
    for c in copies:
        first, end = element_span(c.region.relative_to(saved.box), saved.box.lengths)
        lo = first if lo is None else min(lo, first)
        hi = max(hi, end)
    start, stop = (lo or 0) * item, hi * item
    if verify:
        # Whole checksum chunks that are also whole elements: with a chunk size that is not a
        # multiple of the element size (100 bytes of float64) the range began inside an
        # element, and the copies, which count whole elements from its start, took bytes
        # shifted by the remainder, silently.
        start, stop = widen_to_chunks(start, stop, saved.bytes.byte_length, math.lcm(chunk_bytes, item))
    return start, stop


def _untied_into_tied(tensors: dict[str, Any], meta: CheckpointMetadata) -> dict[str, StateMismatchError]:
    """Keys that are one tensor here (tied weights) but were saved with different bytes (an
    untied model's checkpoint). Both would be read into the same memory: the checksum check
    of one read saw the other's bytes and called an intact file corrupt, and without checks
    one of the two values won, silently."""
    by_memory: dict[tuple[Any, ...], list[str]] = {}
    for key, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.numel() or meta.tensor(key) is None:
            continue
        local = getattr(t, "_local_tensor", t)
        try:
            ident = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
                     tuple(local.stride()), local.dtype)
        except (RuntimeError, NotImplementedError):  # no storage to compare (meta, fake)
            continue
        if ident[0]:
            by_memory.setdefault(ident, []).append(key)
    problems: dict[str, StateMismatchError] = {}
    for keys in (k for k in by_memory.values() if len(k) > 1):
        saved = {k: sorted((b.box.offsets, b.box.lengths, b.bytes.byte_length, tuple(b.bytes.checksums))
                           for b in meta.boxes_of(k)) for k in keys}
        differ = [k for k in keys[1:] if saved[k] != saved[keys[0]]]
        if differ:
            error = StateMismatchError(
                f"{keys[0]} and {differ[0]} are one tensor in this state (tied weights) but the "
                "checkpoint holds different values for them (saved untied); load into a model "
                "built without tying them, or leave one out of the state and load with strict=False")
            problems.update((k, error) for k in keys)
    return problems


def _local_of(value: Any) -> Any:
    """The tensor a target's bytes land in: a shard's data, a DTensor's local tensor."""
    return value.data if isinstance(value, TensorShard) else getattr(value, "_local_tensor", value)


def _check_writable(key: str, value: Any) -> None:
    """A target must have memory of its own for each element: a meta tensor has none, and one
    whose elements are one memory location (``expand()``: stride 0) cannot hold a loaded value
    (torch refused the copy with a bare RuntimeError after reading)."""
    t = _local_of(value)
    if isinstance(t, torch.Tensor) and t.is_meta:
        # Copies into a meta tensor do nothing: the load reported success and filled nothing.
        raise StateMismatchError(
            f"{key}: the tensor to load into is on the meta device (it has no memory); allocate "
            "the model first (module.to_empty(device=...)), then load")
    if isinstance(t, torch.Tensor) and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
        raise StateMismatchError(
            f"{key}: the tensor to load into repeats one memory location along a dimension (an "
            "expand()ed view, stride 0), so it cannot hold the saved values; clone() it before loading")


def _target_memory(value: Any) -> tuple[torch.Tensor, int] | None:
    """A target's local tensor and its storage's address; None when it has no memory to tell
    (meta, fake, empty)."""
    t = _local_of(value)
    if not isinstance(t, torch.Tensor) or not t.numel():
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (t, ptr) if ptr else None


def _extent(t: torch.Tensor, ptr: int) -> tuple[int, int, int, tuple[Any, ...]]:
    """(storage address, first byte, end byte, view) of a tensor's memory."""
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    item = t.element_size()
    return ptr, t.storage_offset() * item, (last + 1) * item, (tuple(t.shape), tuple(t.stride()), t.dtype)


def _sharing_memory(tensors: dict[str, Any]) -> dict[str, str]:
    """Keys whose target memory overlaps another key's as a different view (a weight tied
    through ``.t()``, two slices of one buffer), each with one such other key. Reads straight
    into such memory checked one key's bytes after the other key's had landed there ("the file
    is corrupt"), or one value silently overwrote the other's; identical views are
    ``_untied_into_tied``'s. Extents are taken only of tensors whose storage another target
    also uses (most have their own), then swept in order: O(n log n)."""
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for key, value in tensors.items():
        if (memory := _target_memory(value)) is not None:
            by_storage.setdefault(memory[1], []).append((key, memory[0]))
    spans = sorted(((*_extent(t, ptr), key) for ptr, group in by_storage.items() if len(group) > 1
                    for key, t in group), key=lambda span: span[:3])  # views hold dtypes, which do not order
    out: dict[str, str] = {}
    reach: tuple[int, int, Any, str] | None = None  # (storage, end byte, view, key) reaching furthest
    for ptr, first, end, view, key in spans:
        if reach is not None and reach[0] == ptr and first < reach[1] and view != reach[2]:
            out.setdefault(key, reach[3])
            out.setdefault(reach[3], key)
        if reach is None or reach[0] != ptr or end > reach[1]:
            reach = (ptr, end, view, key)
    if out:  # a key tied to a marked one (the same view) reads into the same memory too
        marked = {span[:4]: out[span[4]] for span in spans if span[4] in out}
        for *where, key in spans:
            if tuple(where) in marked:
                out.setdefault(key, marked[tuple(where)])
    return out


def _check_shared_memory(reads: Iterable[BoxRead], sharing: dict[str, str]) -> None:
    """Every value copied into memory that two keys share is still there once all copies are
    done: else the checkpoint holds different values for the two keys (saved untied)."""
    for read in reads:
        for dst, src in read.kept or ():
            if not torch.equal(_bytes_of(dst).cpu(), _bytes_of(src).cpu()):  # a CUDA target: src on the host
                raise StateMismatchError(
                    f"{read.key} and {sharing[read.key]} share memory in this state (one is a view "
                    "of the other, e.g. a weight tied through .t(), or both are slices of one "
                    "buffer) but the checkpoint holds different values for the shared elements; "
                    "load into a state that does not share them, or leave one out and load with "
                    "strict=False")


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The values' bytes, so NaNs and signed zeros compare exactly."""
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


def _open_checkpoint(url: str) -> tuple[Storage, str, CheckpointMetadata, bytes]:
    """Resolve ``url`` and read its metadata; an overwrite swapping the checkpoint in between
    the two hides the metadata for a moment, so a vanished file is looked up again."""
    bad: bytes | None = b""  # the identity of the metadata that last failed its check
    for _attempt in range(50):
        storage, path = resolve(url)
        try:
            meta, identity = read_metadata_identified(storage, path)
            return storage, path, meta, identity
        except FileNotFoundError:
            time.sleep(0.02)
        except CorruptCheckpointError:
            # An overwrite replacing the metadata while an object store serves it in ranged
            # parts can tear one read; damaged metadata reads the same bytes again.
            now = metadata_identity(storage, path)
            if now == bad:
                raise
            bad = now
            time.sleep(0.02)
    raise CheckpointReplacedError(f"{url}: the checkpoint kept being replaced or removed while the load "
                                  "started; load again once the saves to it are done")


def _plan_local(url: str, state: dict[str, Any], framework: str | None, comm: Communicator,
                verify: bool, fqn_map: Callable[[str], str] | None) -> _LocalPlan:
    with span("load.metadata"):
        storage, path, meta, identity = _open_checkpoint(url)
        scope_step(meta.step)
    verify = verify and getattr(storage, "checksummed", True)
    object_keys = {o.key for o in meta.objects}
    saved_keys = {tm.key for tm in meta.tensors} | object_keys
    tensor_roots = {tm.key.split("/", 1)[0] for tm in meta.tensors}
    by_parent: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}

    def saved_tensors(prefix: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if not by_parent:  # built once, at an optimizer's first question: a model-only load never asks
            for tm in meta.tensors:
                parent, _, name = tm.key.rpartition("/")
                by_parent.setdefault(parent, {})[name] = (tuple(tm.shape), dtype_from_name(tm.dtype))
        return by_parent.get(prefix, {})

    flat = flatten_state(
        state, for_load=True, fqn_map=fqn_map,
        has_saved_state=lambda prefix: any(k.startswith(prefix) for k in saved_keys),
        saved_as_tensors=lambda key: key in tensor_roots and key not in object_keys,
        saved_tensors=saved_tensors,
    )
    stamp_topology(flat.tensors.values())
    planner = get_planner(framework, flat, comm)
    file_index = {f.name: i for i, f in enumerate(meta.files)}
    problems: list[StateMismatchError] = []
    reads: dict[tuple[int, int], BoxRead] = {}
    wanted_targets: list[tuple[str, Any]] = []  # every target piece, for the coverage check
    source = storage.url(path)
    with span("load.plan"):
        tied = _untied_into_tied(flat.tensors, meta)
        problems.extend({id(e): e for e in tied.values()}.values())  # one per tied group
        sharing = _sharing_memory(flat.tensors)
        for key, tensor in flat.tensors.items():
            tm = meta.tensor(key)
            if tm is None or key in tied:  # a key refused is never read into
                continue
            try:
                _check_tensor(key, tensor, tm.shape, tm.dtype, planner.global_shape(tensor))
                _check_writable(key, tensor)
            except StateMismatchError as exc:
                problems.append(exc)
                continue
            dtype = dtype_from_name(tm.dtype)
            targets = planner.pieces(key, tensor)
            wanted_targets.extend((key, t) for t in targets)
            for saved in meta.boxes_of(key, touching=[t.box for t in targets]):
                copies = []
                for target in targets:
                    region = saved.box.intersect(target.box)
                    if region is not None and not region.is_empty():
                        copies.append(Copy(region, target))
                if not copies:
                    continue
                lo, hi = _needed_range(saved, copies, dtype.itemsize, verify, meta.chunk_bytes)
                read = BoxRead(key, saved.bytes.file, saved.bytes.byte_offset, saved.bytes.byte_length,
                               lo, hi, saved.bytes.checksums, dtype, saved.box, copies)
                if key in sharing:  # into its own buffer, copied in, checked after the load
                    read.kept = []
                else:
                    read.direct = direct_target(read)
                add_read(reads, (file_index[saved.bytes.file], saved.bytes.byte_offset), read, source)
        # Per-rank objects come from the same rank when the world is unchanged, else from
        # rank 0 (replicated values such as counters stay right; see docs/format.md).
        source_rank = comm.rank if meta.world_size == comm.world_size else 0
        if meta.world_size != comm.world_size:
            _check_splittable(meta, flat, comm.world_size)
        for obj in meta.objects:
            if obj.rank is None:
                wanted = obj.key in flat.shared_objects or _accepted(flat.accept_prefixes, obj.key)
            else:
                wanted = obj.key in flat.rank_objects and obj.rank == source_rank
            if wanted:
                b = obj.bytes
                add_read(reads, (file_index[b.file], b.byte_offset), BoxRead(
                    obj.key, b.file, b.byte_offset, b.byte_length, 0, b.byte_length, b.checksums), source)
        check_shared_objects(meta, flat.shared_objects, source)
        check_coverage(wanted_targets, reads.values(), source)
    needs = [Need(f, r.byte_offset, r.byte_length, r.lo, r.hi) for (f, _), r in reads.items()]
    return _LocalPlan(storage, path, meta, flat, reads, needs, problems, identity, verify, sharing)


def _check_files(plan: _LocalPlan) -> None:
    """Every storage file this rank reads has the recorded size and header (see
    ``check_file_sizes``); run while the certain boxes are already being read (its storage
    operations report their own spans)."""
    try:
        check_file_sizes(plan.storage, plan.path, plan.meta, {r.file for r in plan.reads.values()},
                         headers=plan.verify)
    except CorruptCheckpointError as exc:
        _check_unchanged(plan.storage, plan.path, plan.identity, exc)
        raise


def _preferred(plan: _LocalPlan, world: int) -> list[int] | None:
    return preferred_readers([f.rank for f in plan.meta.files], plan.meta.world_size, world)


def _prefetch(plan: _LocalPlan, rank: int, world: int, xdev: torch.device | None, threads: int | None
              ) -> Prefetch | None:
    """Start reading the boxes this rank is certain to read (``Prefetch``): over gloo only,
    where every box of a CPU target stays where it was read (NCCL stages exchanged boxes on
    the device), and not when ``BCP_LOAD_EARLY=0``."""
    if xdev is not None or not early_setting():
        return None
    writers = _preferred(plan, world)
    if writers is None:
        return None
    keys = [k for k, r in plan.reads.items()  # keyed by (file index, byte offset)
            if r.box is not None and r.direct is not None and r.hi > r.lo and writers[k[0]] == rank]
    if not keys:
        return None
    # Threads as asked for, else this rank's share of the host's: the ranks on the host are
    # known only after the all-gather, so torchrun's LOCAL_WORLD_SIZE, else the world (which
    # can only make the share smaller).
    return Prefetch(plan.storage, plan.path, plan.reads, keys, verify=plan.verify,
                    chunk_bytes=plan.meta.chunk_bytes, threads=threads or share_of_host(_local_ranks(world)))


def _local_ranks(world: int) -> int:
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    # isdecimal, not isdigit: int() refuses digits such as '²' that isdigit accepts
    return min(world, int(raw)) if raw.isdecimal() and int(raw) > 0 else world


def _exchange_device(plan: _LocalPlan, process_group: Any) -> torch.device | None:
    """This rank's device for an NCCL exchange (its flag on the load's all-gather)."""
    tensors = [c.target.data for r in plan.reads.values() for c in r.copies]
    return exchange_device([*tensors, *_held_tensors(plan.flat.tensors.values())], process_group)


def _held_tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    """The local tensors of a state's targets: ``flat.tensors`` also holds ``TensorShard`` and
    ``ShardSet`` wrappers (FSDP1, Megatron), which have no device of their own to ask."""
    out: list[torch.Tensor] = []
    for value in values:
        for piece in value.shards if isinstance(value, ShardSet) else (value,):
            t = _local_of(piece)
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def _check_keys(plan: _LocalPlan, everyone: list[Any], strict: bool, comm: Communicator
                ) -> tuple[list[str], list[str]]:
    """Missing and unexpected keys; under ``strict`` every rank raises if any rank has some."""
    meta, flat = plan.meta, plan.flat
    objects = {o.key for o in meta.objects}
    saved = {t.key for t in meta.tensors} | objects
    wanted_anywhere = set().union(*(v["wanted"] for v in everyone))
    groups = set().union(*(v["groups"] for v in everyone))
    prefixes = [p for v in everyone for p in v["prefixes"]]
    # Per-rank state that only some ranks saved is missing for a rank that takes it from one
    # that did not (it was called a damaged checkpoint, though a save writes it so).
    have = {(o.key, o.rank) for o in meta.objects}
    per_rank = {o.key for o in meta.objects if o.rank is not None}
    same_world = meta.world_size == comm.world_size

    def missing_on(rank: int, wanted: set[str]) -> set[str]:
        source = rank if same_world else 0  # the saved rank its per-rank objects come from
        return (wanted - saved) | {k for k in wanted & per_rank if (k, source) not in have}

    missing = sorted(missing_on(comm.rank, _wanted(flat)))
    # Prefixes take objects the state cannot list (a float step); a saved tensor nothing
    # loads into is unexpected (it was dropped silently: optimizer state of no target).
    unexpected = sorted(k for k in saved - wanted_anywhere
                        if k.split("/", 1)[0] in groups and not (k in objects and _accepted(prefixes, k)))
    if not strict:
        return missing, unexpected
    url = plan.storage.url(plan.path)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_listing(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the state: {_listing(unexpected)}")
        raise MissingKeysError(
            f"{url}: state and checkpoint keys differ; " + "; ".join(parts)
            + ". Pass strict=False to load the keys they share", missing, unexpected,
        )
    others = {r: sorted(m) for r, v in enumerate(everyone) if (m := missing_on(r, v["wanted"]))}
    if others:
        raise RankFailedError(
            f"checkpoint load failed: keys missing from {url} on rank(s) {sorted(others)}: "
            + "; ".join(f"rank {r}: {_listing(k)}" for r, k in sorted(others.items())),
            {r: "missing keys" for r in others},
        )
    return missing, unexpected


def _load_local(url: str, state: dict[str, Any], framework: str | None, strict: bool,
                comm: Communicator, verify: bool, threads: int | None, phases: dict[str, float],
                fqn_map: Callable[[str], str] | None, process_group: Any) -> LoadResult:
    early = _Early()
    try:
        return _load_planned(url, state, framework, strict, comm, verify, threads, phases, fqn_map,
                             process_group, early)
    finally:
        early.close()


@dataclass
class _Early:
    """What a load starts before the plan is agreed: the reads of boxes this rank is certain
    to read, and the file size and header check (cold reads that, run in line, kept the
    all-gather waiting for the slowest rank's: 0.14-0.26 s beside the early reads)."""

    prefetch: Prefetch | None = None
    files_checked: Future | None = None

    def check_files(self, plan: _LocalPlan) -> None:
        self.files_checked = Future()
        threading.Thread(target=_run_into, args=(self.files_checked, _check_files, plan),
                         name="bcp-check-files", daemon=True).start()

    def close(self) -> None:
        """Nothing started here outlives the load."""
        if self.prefetch is not None:
            self.prefetch.close()
        if self.files_checked is not None:
            futures_wait([self.files_checked])


def _run_into(future: Future, fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # handed to the thread that waits for it
        future.set_exception(exc)
    else:
        future.set_result(None)


def _load_planned(url: str, state: dict[str, Any], framework: str | None, strict: bool,
                  comm: Communicator, verify: bool, threads: int | None, phases: dict[str, float],
                  fqn_map: Callable[[str], str] | None, process_group: Any, early: _Early
                  ) -> LoadResult:
    t = time.perf_counter()
    local_error: BaseException | None = None
    xdev: torch.device | None = None
    try:
        threads = threads or read_threads_setting()
        plan = _plan_local(url, state, framework, comm, verify, fqn_map)
        xdev = _exchange_device(plan, process_group)
        early.prefetch = _prefetch(plan, comm.rank, comm.world_size, xdev, threads)
        if early_setting():
            early.check_files(plan)
        else:  # in line, before the all-gather, as loads did before (the benchmark's baseline)
            _check_files(plan)
        mine = Outcome(value={"wanted": _wanted(plan.flat), "groups": set(plan.flat.kinds),
                              "prefixes": plan.flat.accept_prefixes, "needs": plan.needs,
                              "problems": bool(plan.problems), "host": socket.gethostname(),
                              "identity": plan.identity,
                              "nccl": xdev is not None})
    except BaseException as exc:  # raised after the all-gather (raise_failures): no rank waits
        local_error, mine = exc, Outcome.failure(exc)
    # The one collective before reading: every rank's keys and byte ranges (or its failure).
    everyone = comm.all_gather(mine)
    raise_failures(everyone, "checkpoint load", local_error)
    values = [o.value for o in everyone]
    if len({v["identity"] for v in values}) > 1:  # latest moved, or an overwrite, between ranks
        raise CheckpointReplacedError(
            f"{url}: the ranks found different checkpoints there (it was replaced, or its latest "
            "pointer moved, while the load started); load again"
        )
    missing, unexpected = _check_keys(plan, values, strict, comm)
    if plan.problems:
        if len(plan.problems) == 1:
            raise plan.problems[0]
        raise type(plan.problems[0])("; ".join(str(p) for p in plan.problems[:_MAX_LISTED]))
    failed = [r for r, v in enumerate(values) if v["problems"]]
    if failed:
        raise RankFailedError(f"checkpoint load failed: shape or dtype mismatch on rank(s) {failed}",
                              {r: "shape or dtype mismatch" for r in failed})
    units = plan_reads([v["needs"] for v in values], _preferred(plan, comm.world_size))
    if threads is None:
        threads = share_of_host(sum(v["host"] == values[comm.rank]["host"] for v in values))
    phases["plan"] = time.perf_counter() - t

    t = time.perf_counter()
    # Every rank takes the same transport, from every rank's flag (see ``transport``).
    transport = choose_transport([v["nccl"] for v in values], xdev, process_group, comm.group)
    file_index = {f.name: i for i, f in enumerate(plan.meta.files)}
    pipeline = LoadPipeline(
        plan.storage, plan.path, units, plan.reads,
        rank=comm.rank, group=transport.group, global_rank=lambda r: comm.global_ranks[r],
        threads=threads, verify=plan.verify, chunk_bytes=plan.meta.chunk_bytes, device=transport.device,
        batched=transport.batched, control=comm.group, distributed=comm.distributed,
        prefetched=early.prefetch.futures if early.prefetch is not None else None,
        # A file that fails its check stops every rank at the first window's agreement.
        checked=early.files_checked,
    )
    outcome = pipeline.run()
    phases["read"] = time.perf_counter() - t
    _check_unchanged(plan.storage, plan.path, plan.identity, outcome.error)
    if outcome.error is not None:
        raise outcome.error
    _check_shared_memory(plan.reads.values(), plan.sharing)

    t = time.perf_counter()
    with span("load.apply"):
        shared: dict[str, Any] = {}
        ranked: dict[str, Any] = {}
        for obj in plan.meta.objects:
            read = plan.reads.get((file_index[obj.bytes.file], obj.bytes.byte_offset))
            if read is None:
                continue
            data = read.buffer.cpu().numpy().tobytes() if read.buffer is not None else b""
            (shared if obj.rank is None else ranked)[obj.key] = codec.decode(data)
        for apply in plan.flat.appliers:
            apply(shared, ranked)
    phases["apply"] = time.perf_counter() - t
    skipped = plan.meta.layout.get("skipped")
    skipped = [s for s in skipped if isinstance(s, str)] if isinstance(skipped, list) else []
    return LoadResult(plan.storage.url(plan.path), plan.meta.step, plan.meta.framework, missing,
                      unexpected, outcome.bytes_read, transport=transport.kind, skipped=skipped)
