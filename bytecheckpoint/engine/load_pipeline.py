"""The read side of a load: every read unit is read once, by one rank, and sent to the others.

Units are processed in windows of about ``window_bytes``. Boxes a ``Prefetch`` began reading
before the plan was agreed are not read again: their units wait for the prefetch. For each
window a rank reads its own units on a thread pool (ranged, verified), receives the units
others read for it, sends its own to the ranks that need them, and copies finished boxes into
the target tensors.
Reading the next window overlaps the exchange and copies of this one. Every rank runs the
same windows in the same order, so the point-to-point messages always pair up; a failure on
any rank (a bad read, an allocation) stops every rank before the next exchange, and is
raised after the loop.

On CPU the exchange runs over the gloo control group with host buffers. When every rank
can (``engine.transport``), the units go over NCCL instead: boxes that are exchanged get
buffers on the rank's device (NCCL takes no host tensors: a CPU target such as Adam's
``step`` is staged through one), units are read into a reused pinned window arena and copied
on a side stream. Before any window's point-to-point operations are posted, the ranks agree
over gloo that none has failed, so either every rank posts them or every rank stops.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from telemetry import span

from ..errors import CheckpointError, CorruptCheckpointError, PlanningError, RankFailedError
from ..format.boxes import Box, element_span, row_major_strides
from ..format.checksums import bad_chunks
from ..format.dtypes import byte_view
from ..format.file_headers import DIRECT_PADDING
from ..planners import LocalShard
from ..runtime import devices
from ..runtime.comm import group_failure
from ..runtime.devices import on_device
from ..storage import Storage
from .read_plan import ReadUnit
from .staging import HostBufferPool, pool, settle_streams

DEFAULT_WINDOW_BYTES = 256 << 20
# Bytes per sequential request of early reads: one local descriptor's worth
# (``storage.local._DESCRIPTOR_BYTES``), so each request's checks run while the next is read.
# Cold 4-rank loads, medians of 6 alternating: 0.518 s at 64 MiB against 0.555 at 256 MiB
# (1.3 GB) and 1.311 against 1.367 s (3.56 GB); 32 MiB was slower at 3.56 GB (1.381 s).
EARLY_RUN_BYTES = 64 << 20


@dataclass
class Copy:
    region: Box  # global coordinates, inside both the saved box and the target shard
    target: LocalShard


@dataclass
class BoxRead:
    """What this rank needs of one saved box (or stored object): bytes ``[lo, hi)``."""

    key: str
    file: str
    byte_offset: int  # of the box in its file
    byte_length: int
    lo: int
    hi: int
    checksums: tuple[int, ...]
    dtype: torch.dtype = torch.uint8
    box: Box | None = None  # None for a stored object
    copies: list[Copy] = field(default_factory=list)
    direct: torch.Tensor | None = None  # target bytes to read straight into
    buffer: torch.Tensor | None = None
    # (target view, copy of the values put there) of each copy, kept when the target shares
    # memory with another key's: the load checks afterwards that no other copy overwrote them.
    kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None


def direct_target(read: BoxRead) -> torch.Tensor | None:
    """The target's own bytes when the needed range lands in one contiguous CPU view."""
    if read.box is None or len(read.copies) != 1:
        return None
    c = read.copies[0]
    # The whole target (a same-layout load): no indexing, which costs more than the rest.
    whole = c.region == c.target.box
    dst = c.target.data if whole else c.target.data[c.region.relative_to(c.target.box).slices()]
    first, end = element_span(c.region.relative_to(read.box), read.box.lengths)
    item = read.dtype.itemsize
    exact = (first * item, end * item) == (read.lo, read.hi) and (end - first) == c.region.numel
    if (not exact or dst.device.type != "cpu" or not dst.is_contiguous() or dst.dtype != read.dtype
            or dst.is_conj() or dst.is_neg()):  # a lazy conj/neg view's bytes are not its values
        return None
    return byte_view(dst)


def copy_out(read: BoxRead, non_blocking: bool = False) -> None:
    """Copy each needed region of a filled box buffer into its target view."""
    if read.box is None or (read.direct is not None and read.buffer is read.direct):
        return  # an object, or read straight into the target (not when staged for NCCL)
    assert read.buffer is not None
    item = read.dtype.itemsize
    if read.lo % item:  # the elements below would be counted from a shifted start
        raise PlanningError(f"{read.key}: the load plan reads a box from byte {read.lo}, inside an "
                            f"element of {item} bytes; nothing was copied from it (an internal "
                            "error: please report it)")
    values = read.buffer.view(read.dtype) if read.buffer.numel() else torch.empty(0, dtype=read.dtype)
    # as_strided places its view from the start of the storage, not of ``values``: a box
    # buffer is often a slice of a window arena (CUDA targets), so its own offset is added.
    # Its bounds are then checked against the whole arena, so they are checked here against
    # the buffer: a region outside it would read a neighbouring box's bytes.
    held = range(read.lo // item, read.lo // item + values.numel())
    base = values.storage_offset() - held.start
    strides = row_major_strides(read.box.lengths)
    for c in read.copies:
        rel = c.region.relative_to(read.box)
        first, end = element_span(rel, read.box.lengths)
        if end > first and (first not in held or end - 1 not in held):
            raise PlanningError(f"{read.key}: the load plan copies elements {first}..{end} of a box "
                                f"from a buffer holding {held.start}..{held.stop}; nothing was "
                                "copied from it (an internal error: please report it)")
        src = values.as_strided(rel.lengths, strides, base + first)
        dst = c.target.data[c.region.relative_to(c.target.box).slices()]
        if dst.device.type == "cuda" and src.device.type == "cpu":
            with span("load.h2d", bytes=c.region.numel * item):
                dst.copy_(src, non_blocking=non_blocking)
        else:
            dst.copy_(src)
        if read.kept is not None:
            read.kept.append((dst, src.clone()))


def follows(start: int, end: int) -> bool:
    """Whether bytes at ``start`` continue a read that ended at ``end``: back to back, or
    behind a padding entry (fewer than ``DIRECT_PADDING`` bytes, read and dropped: less than
    one page, cheaper than a request of its own)."""
    return 0 <= start - end < DIRECT_PADDING


def read_spans(storage: Storage, full: str, spans: list[tuple[int, memoryview]]) -> list[int]:
    """Fill views that lie in order in one file (``(file offset, view)``, each ``follows``
    the one before) with one sequential request; returns the bytes that landed in each."""
    scratch = memoryview(bytearray(DIRECT_PADDING))  # the padding's bytes land here
    views: list[memoryview] = []
    end = spans[0][0]
    for start, view in spans:
        if start > end:
            views.append(scratch[: start - end])
        views.append(view)
        end = start + len(view)
    got = storage.read_into_many(full, spans[0][0], views)
    out: list[int] = []
    end = spans[0][0]
    for start, view in spans:
        got -= start - end
        out.append(max(0, min(got, len(view))))
        got -= len(view)
        end = start + len(view)
    return out


def contiguous_runs(units: list[tuple[int, ReadUnit]], limit: int) -> list[list[tuple[int, ReadUnit]]]:
    """Split ``(index, unit)`` pairs (in file order) into runs of units that lie back to back
    in one file (or behind padding: ``follows``), each at most ``limit`` bytes unless one unit
    alone is larger. A run is one sequential read: a checkpoint of many small tensors is read
    in a few large requests."""
    runs: list[list[tuple[int, ReadUnit]]] = []
    end, size, file = -1, 0, -1
    for j, u in units:
        start = u.box_offset + u.start
        if runs and u.file == file and follows(start, end) and size + u.nbytes <= limit:
            runs[-1].append((j, u))
            size += u.nbytes
        else:
            runs.append([(j, u)])
            size = u.nbytes
        end, file = u.box_offset + u.stop, u.file
    return runs


def balanced_windows(units: list[ReadUnit], limit: int) -> list[list[ReadUnit]]:
    """Windows of about ``limit`` bytes in which every reader has about the same share.

    Each saved box (all its units, so its copies run when the window lands) belongs to the
    reader of most of its bytes; window k takes the next ``limit / readers`` bytes of every
    reader's boxes, in file order. Cutting the plan in file order instead gave each window to
    one or two ranks (in a same-layout load each rank reads its own files) while the others
    waited at the window's agreement: 1.8 streams on average where the disk wanted 4.
    Identical on every rank for the same units; within a window units stay in file order."""
    boxes: dict[tuple[int, int], list[ReadUnit]] = {}
    for u in units:
        boxes.setdefault(u.box, []).append(u)
    queues: dict[int, list[list[ReadUnit]]] = {}
    for box_units in boxes.values():
        bytes_by_reader: dict[int, int] = {}
        for u in box_units:
            bytes_by_reader[u.reader] = bytes_by_reader.get(u.reader, 0) + u.nbytes
        owner = min(bytes_by_reader, key=lambda r: (-bytes_by_reader[r], r))
        queues.setdefault(owner, []).append(box_units)
    share = max(1, limit // max(1, len(queues)))
    heads = {r: 0 for r in queues}
    out: list[list[ReadUnit]] = []
    while any(heads[r] < len(q) for r, q in queues.items()):
        window: list[ReadUnit] = []
        for r in sorted(queues):
            taken, q = 0, queues[r]
            while heads[r] < len(q) and (taken == 0 or taken + sum(u.nbytes for u in q[heads[r]]) <= share):
                taken += sum(u.nbytes for u in q[heads[r]])
                window.extend(q[heads[r]])
                heads[r] += 1
        window.sort(key=lambda u: (u.file, u.box_offset, u.start))
        out.append(window)
    return out


def check_length(url: str, read: BoxRead, start: int, stop: int, got: int) -> None:
    """Bytes ``[start, stop)`` of ``read``'s box were all read (``got`` of them)."""
    if got != stop - start:
        raise CorruptCheckpointError(
            f"{url}: truncated: wanted {stop - start} bytes at {read.byte_offset + start}, got {got}")


def check_sums(url: str, read: BoxRead, start: int, stop: int, view: memoryview, chunk_bytes: int
               ) -> None:
    """Bytes ``[start, stop)`` of ``read``'s box, read into ``view``, match their checksums
    where they cover whole checksum chunks."""
    aligned = start % chunk_bytes == 0 and (stop % chunk_bytes == 0 or stop == read.byte_length)
    if aligned and bad_chunks(view, start, list(read.checksums), chunk_bytes):
        raise CorruptCheckpointError(
            f"{url}: checksum mismatch in {read.key} (bytes {read.byte_offset + start}.."
            f"{read.byte_offset + stop}); the file is corrupt: restore it or load another checkpoint"
        )


Checked = tuple[BoxRead, int, int, memoryview]  # a box's bytes [start, stop), landed in a view


class ChecksBehind:
    """Verifies what reader threads have read on a thread of its own, so each reader goes on
    to its next request while the bytes it just read are hashed. Hashed on the reader, the
    stream stood still meanwhile: a cold 1.3 GB load took 0.60 s against 0.55 s with the
    hash left out (4 ranks, medians of 8, alternating).

    A read's future yields the future of its checks (None when there is nothing to check):
    ``settle`` waits for both. ``close`` waits for every check, so none reads a buffer after
    its load is over."""

    def __init__(self, verify: bool, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="bcp-verify") if verify else None

    def submit(self, url: str, done: list[Checked]) -> Future | None:
        if self._pool is None or not done:
            return None
        return self._pool.submit(self._check, url, done)

    def _check(self, url: str, done: list[Checked]) -> None:
        for read, start, stop, view in done:
            check_sums(url, read, start, stop, view, self.chunk_bytes)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def settle(read: Future) -> None:
    """Wait for a read and then for its checks (``ChecksBehind``); raise what either raised."""
    checks = read.result()
    if checks is not None:
        checks.result()


Key = tuple[int, int]  # (file index, byte offset) of a saved box


class Prefetch:
    """Reads, while the read plan is still being agreed, the boxes this rank is certain to read:
    those in files it is the preferred reader of that land straight in its CPU targets
    (``read_plan.plan_reads`` gives every piece of such a box this rank needs to this rank, so
    it reads exactly ``[lo, hi)`` of each). Planning before the first read (the all-gather waiting for the
    slowest rank, the plan, the file checks) was a quarter of a cold 1.3 GB load.

    One reader thread, one sequential request per run of back-to-back boxes (up to
    ``run_bytes``), in file order, each verified as the pipeline verifies its reads
    (``ChecksBehind``). ``futures`` maps each box to the read that fills it; ``LoadPipeline``
    waits on those (``settle``) instead of reading the box again."""

    def __init__(self, storage: Storage, path: str, reads: dict[Key, BoxRead], keys: list[Key], *,
                 verify: bool, chunk_bytes: int, run_bytes: int = EARLY_RUN_BYTES,
                 threads: int = 1) -> None:
        self.storage, self.path = storage, path
        self.futures: dict[Key, Future] = {}
        self._checks = ChecksBehind(verify and bool(keys), chunk_bytes)
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="bcp-prefetch") if keys else None
        runs: list[list[BoxRead]] = []
        run_keys: list[list[Key]] = []
        end, size, file = -1, 0, -1
        for key in sorted(keys):
            read = reads[key]
            read.buffer = read.direct  # read straight into the target, as the pipeline would
            start = read.byte_offset + read.lo
            if runs and key[0] == file and follows(start, end) and size + read.hi - read.lo <= run_bytes:
                runs[-1].append(read)
                run_keys[-1].append(key)
                size += read.hi - read.lo
            else:
                runs.append([read])
                run_keys.append([key])
                size = read.hi - read.lo
            end, file = read.byte_offset + read.hi, key[0]
        for run, ks in zip(runs, run_keys):
            assert self._pool is not None
            future = self._pool.submit(self._read, run)
            self.futures.update((k, future) for k in ks)

    def _read(self, run: list[BoxRead]) -> Future | None:
        full = posixpath.join(self.path, run[0].file)
        spans = [(r.byte_offset + r.lo, memoryview(r.direct.numpy())) for r in run if r.direct is not None]
        with span("load.read", path=full, bytes=sum(len(v) for _, v in spans)):
            got = read_spans(self.storage, full, spans)
        url = self.storage.url(full)
        for read, have in zip(run, got):
            check_length(url, read, read.lo, read.hi, have)
        return self._checks.submit(url, [(r, r.lo, r.hi, v) for r, (_, v) in zip(run, spans)])

    def close(self) -> None:
        """Stop what has not started and wait for what has: no thread writes into a target,
        nor hashes one, after the load returns or raises."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._checks.close()


@dataclass
class PipelineResult:
    bytes_read: int
    bytes_received: int
    error: BaseException | None


# Held by the load using the load pool's arena: loads run by two threads at once would read
# into the same memory (and one could unpin it under the other's copies), so the second one
# gets an arena of its own. Never waited for: two threads' distributed loads on different
# groups would otherwise wait for each other across ranks.
_SHARED_ARENA = threading.Lock()


class _HostWindows:
    """Host memory for the windows of one load: two halves of one arena from the load's
    pinned pool, used by alternate windows. Window ``i + 2`` reuses window ``i``'s half only
    after window ``i``'s copies have completed (``LoadPipeline._finish`` waits for them), so
    no unit allocates or pins memory of its own. ``close()`` once no copy reads it."""

    def __init__(self, half_bytes: int, device: torch.device | None) -> None:
        self.half = _aligned(half_bytes)
        self.arena: torch.Tensor | None = None
        self.used = [0, 0]
        self._own: HostBufferPool | None = None  # this load's arena, when the shared one is busy
        self._shared = bool(self.half) and _SHARED_ARENA.acquire(blocking=False)
        try:
            if self._shared:
                self.arena = pool(True, purpose="load").reserve(2 * self.half, device)
            elif self.half:
                self._own = HostBufferPool(True)
                self.arena = self._own.reserve(2 * self.half, device)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Give the arena back (the load's copies from it have completed)."""
        self.arena = None
        if self._own is not None:
            self._own._release()  # unpinned before it is dropped
            self._own = None
        if self._shared:
            self._shared = False
            _SHARED_ARENA.release()

    def reset(self, half: int) -> None:
        self.used[half] = 0

    def take(self, nbytes: int, half: int) -> torch.Tensor:
        if self.arena is None or self.used[half] + nbytes > self.half:  # not expected: sized ahead
            return torch.empty(nbytes, dtype=torch.uint8)
        start = half * self.half + self.used[half]
        self.used[half] += _aligned(nbytes)
        return self.arena[start : start + nbytes]


def _aligned(n: int) -> int:
    return -(-n // 64) * 64


_NO_FAILURE = 2**31 - 1


@contextmanager
def _transport(op: str, group: Any) -> Iterator[None]:
    """A failed collective or transfer (a rank died, the group's timeout) as a named error."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, CheckpointError):
            raise
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        raise group_failure(exc, op, world) from exc


class LoadPipeline:
    """Runs the read units of one load on this rank (see the module docstring).

    ``device`` is where exchanged buffers live (a CUDA device when ``batched``, the NCCL
    transport); ``control`` is the gloo group of the per-window agreement when ``distributed``
    (None there names the default group)."""

    def __init__(self, storage: Storage, path: str, units: list[ReadUnit],
                 mine: dict[tuple[int, int], BoxRead], *, rank: int, group: Any,
                 global_rank: Callable[[int], int], threads: int, verify: bool, chunk_bytes: int,
                 device: torch.device, batched: bool = False, control: Any = None,
                 distributed: bool = False, window_bytes: int = DEFAULT_WINDOW_BYTES,
                 prefetched: dict[tuple[int, int], Future] | None = None,
                 checked: Future | None = None) -> None:
        self.storage, self.path = storage, path
        self.units, self.mine, self.rank = units, mine, rank
        self.group, self.global_rank = group, global_rank
        self.threads = threads
        self._checks = ChecksBehind(verify, chunk_bytes)
        self.device, self.batched = device, batched
        self.control, self.distributed = control, distributed
        self.window_bytes = window_bytes
        self.prefetched = prefetched or {}  # boxes already being read (``Prefetch``)
        # The check of the files' sizes and headers, still running: reads start without
        # waiting for it (in a resharded load it took 0.2-0.6 s, the disk busy with the
        # early reads); its failure stops every rank at the first agreement, before any
        # exchange and before the load returns.
        self.checked = checked
        self.error: BaseException | None = None
        self.bytes_read = 0
        self.bytes_received = 0
        self._host: _HostWindows | None = None
        self._h2d: Any = None  # the side stream of staged units' host-to-device copies

    # -- where each box's bytes land -----------------------------------------------------
    def _placement(self, window: list[ReadUnit]) -> dict[tuple[int, int], str]:
        """Per box this rank needs: "device" (exchanged over NCCL: a buffer on ``device``;
        NCCL takes no host memory), "direct" (the CPU target's own bytes), "pinned" (a host
        buffer copied to CUDA targets) or "host"."""
        exchanged = {u.box for u in window
                     if u.needed_by(self.rank) and (u.receivers or u.reader != self.rank)}
        out: dict[tuple[int, int], str] = {}
        for u in window:
            read = self.mine.get(u.box)
            if read is None or u.box in out or not u.needed_by(self.rank):
                continue
            if self.batched and u.box in exchanged:
                out[u.box] = "device"
            elif devices.PRETEND_CUDA_TARGETS and read.box is not None:  # objects have no CUDA target
                out[u.box] = "pinned"
            elif read.direct is not None:
                out[u.box] = "direct"
            elif any(c.target.data.is_cuda for c in read.copies):
                out[u.box] = "pinned"
            else:
                out[u.box] = "host"
        return out

    def _host_need(self, window: list[ReadUnit]) -> int:
        """Host bytes of a window: pinned box buffers, and staging for units this rank reads
        into device buffers."""
        where = self._placement(window)
        boxes = sum(_aligned(self.mine[b].hi - self.mine[b].lo) for b, p in where.items() if p == "pinned")
        staged = sum(_aligned(u.nbytes) for u in window
                     if u.reader == self.rank and where.get(u.box) == "device" and self.device.type == "cuda")
        return boxes + staged

    def _allocate(self, window: list[ReadUnit], half: int) -> None:
        for box, where in self._placement(window).items():
            read = self.mine[box]
            if read.buffer is not None:
                continue
            n = read.hi - read.lo
            if where == "device":
                read.buffer = torch.empty(n, dtype=torch.uint8, device=self.device)
            elif where == "direct":
                read.buffer = read.direct
            elif where == "pinned" and self._host is not None:
                read.buffer = self._host.take(n, half)
            else:
                read.buffer = torch.empty(n, dtype=torch.uint8)

    def _slice(self, u: ReadUnit) -> torch.Tensor:
        read = self.mine[u.box]
        assert read.buffer is not None
        return read.buffer[u.start - read.lo : u.stop - read.lo]

    def _pin_device(self) -> torch.device | None:
        """A CUDA device of this load (the exchange's, else a target's): the window arena is
        pinned there (``HostBufferPool.reserve``)."""
        if self.device.type == "cuda":
            return self.device
        return next((c.target.data.device for read in self.mine.values() for c in read.copies
                     if c.target.data.is_cuda), None)

    # -- reading -------------------------------------------------------------------------
    def _read(self, units: list[tuple[ReadUnit, torch.Tensor | None]]) -> Future | None:
        """Read units that lie back to back in one file with one request, then check each
        (the checksums behind, on ``ChecksBehind``: the future of those checks is returned).
        A unit bound for a device buffer is read into its slice of the pinned window arena
        (``staged``) and copied on the side stream; the exchange waits for that stream."""
        with on_device(self.device):
            first = self.mine[units[0][0].box]
            full = posixpath.join(self.path, first.file)
            offset = units[0][0].box_offset + units[0][0].start
            targets = []
            for u, staged in units:
                dst = self._slice(u)
                host = dst if staged is None else staged
                targets.append((u, dst, host, memoryview(host.numpy()) if u.nbytes else memoryview(b"")))
            with span("load.read", path=full, bytes=sum(u.nbytes for u, _ in units)):
                if len(targets) == 1:  # one large range: the backend splits it over threads
                    got = [self.storage.read_into(full, offset, targets[0][3])]
                else:
                    got = read_spans(self.storage, full, [(u.box_offset + u.start, view)
                                                          for u, _, _, view in targets])
            url = self.storage.url(full)
            for (u, dst, host, _), have in zip(targets, got):
                check_length(url, self.mine[u.box], u.start, u.stop, max(0, min(have, u.nbytes)))
                if host is not dst:
                    with span("load.h2d", bytes=u.nbytes), torch.cuda.stream(self._h2d):
                        dst.copy_(host, non_blocking=True)
            # The staged copies read the pinned bytes on the side stream while they are hashed
            # here; the exchange waits for both.
            return self._checks.submit(url, [(self.mine[u.box], u.start, u.stop, view)
                                             for u, _, _, view in targets])

    def _submit(self, pool: ThreadPoolExecutor, window: list[ReadUnit],
                half: int) -> list[tuple[int, ReadUnit, Future]]:
        if self._host is not None:
            self._host.reset(half)
        self._allocate(window, half)
        if self._h2d is not None:
            # The device buffers just allocated come from the caching allocator on the current
            # stream, perhaps as blocks freed there with kernels still pending on them: the
            # staged units' copies on the side stream must not overtake those kernels.
            self._h2d.wait_stream(torch.cuda.current_stream(self.device))
        mine = [(j, u) for j, u in enumerate(window) if u.reader == self.rank]
        early = [(j, u, self.prefetched[u.box]) for j, u in mine if u.box in self.prefetched]
        mine = [(j, u) for j, u in mine if u.box not in self.prefetched]
        staged: dict[int, torch.Tensor | None] = {}
        for j, u in mine:
            to_device = self._slice(u).device.type == "cuda"
            staged[j] = self._host.take(u.nbytes, half) if to_device and self._host is not None else (
                torch.empty(u.nbytes, dtype=torch.uint8) if to_device else None)
        limit = max(1, self.window_bytes // max(1, self.threads))
        out = early
        for run in contiguous_runs(mine, limit):
            future = pool.submit(self._read, [(u, staged[j]) for j, u in run])
            out.extend((j, u, future) for j, u in run)
        return out

    def _may_read(self) -> bool:
        """No failure yet, the file check's included where it has finished."""
        self._take_check(wait=False)
        return self.error is None

    def _take_check(self, wait: bool) -> None:
        """The file check's outcome, once. Its error names the file and what is wrong with it,
        so it replaces a read's (a missing or short file fails its reads too)."""
        if self.checked is None or not (wait or self.checked.done()):
            return
        failure, self.checked = self.checked.exception(), None
        if failure is not None:
            self.error = failure

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    def _agree(self) -> bool:
        """True when no rank has failed so far. Every rank asks before posting a window's
        point-to-point operations, over the gloo control group, so either all of them post
        or none does: a failed rank never leaves its peers waiting in NCCL or gloo."""
        self._take_check(wait=True)  # the first agreement waits for the file check
        first = torch.tensor([self.rank if self.error is not None else _NO_FAILURE], dtype=torch.int64)
        if self.distributed:
            with _transport("load's agreement", self.control):
                dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.control)
        failed = int(first.item())
        if failed != _NO_FAILURE and self.error is None:
            self.error = RankFailedError(
                f"checkpoint load stopped: rank {failed} failed while reading or preparing the "
                "exchange, so no rank exchanged further (its error is in the load's summary)",
                {failed: "failed before the exchange"})
        return failed == _NO_FAILURE

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> PipelineResult:
        try:
            return self._run_windows()
        finally:
            self._settle_h2d()
            self._checks.close()  # after the readers: their last checks are queued by then
            if self._host is not None:
                self._host.close()

    def _settle_h2d(self) -> None:
        """Wait for the staged units' host-to-device copies, on every way out: a failed window
        never reaches the exchange that orders them, and the pinned arena they read from goes
        back to the pool for the next load, their device buffers to the caching allocator."""
        if self._h2d is not None:
            settle_streams({self.device: self._h2d})  # on the stream's own device

    def _run_windows(self) -> PipelineResult:
        groups = balanced_windows(self.units, self.window_bytes)
        bases = [0]
        for g in groups:
            bases.append(bases[-1] + len(g))  # tags: the unit's index in the whole plan
        readers = ThreadPoolExecutor(max(1, self.threads), thread_name_prefix="bcp-read")
        with on_device(self.device), readers as pool:
            pending: list[tuple[int, ReadUnit, Future]] = []
            try:
                need = max((self._host_need(g) for g in groups), default=0)
                self._host = _HostWindows(need, self._pin_device()) if need else None
                if self.device.type == "cuda":
                    self._h2d = torch.cuda.Stream(self.device)
                pending = self._submit(pool, groups[0], 0) if groups and self._may_read() else []
            except BaseException as exc:  # e.g. out of device memory: reported by the agreement
                self._fail(exc)
            for i, window in enumerate(groups):
                recvs: list[dist.P2POp] = []
                sends: list[dist.P2POp] = []
                reads, pending = pending, []
                try:
                    if self._may_read():
                        recvs = self._receives(window, bases[i])
                        if i + 1 < len(groups):
                            pending = self._submit(pool, groups[i + 1], (i + 1) % 2)
                except BaseException as exc:  # a KeyboardInterrupt too: the others must hear of it
                    self._fail(exc)
                for j, u, fut in reads:  # wait for every read, so no thread writes into a dropped buffer
                    try:
                        settle(fut)
                        self.bytes_read += u.nbytes
                        sends.extend(self._sends(u, bases[i] + j))
                    except BaseException as exc:
                        self._fail(exc)
                if not self._agree():
                    for _, _, fut in pending:
                        fut.cancel()
                    futures_wait([f for _, _, f in pending])
                    break
                self._exchange(i, recvs, sends)
                self._finish(window)
        self._take_check(wait=True)  # no window, so no agreement: the check is still reported
        return PipelineResult(self.bytes_read, self.bytes_received, self.error)

    def _exchange(self, i: int, recvs: list[dist.P2POp], sends: list[dist.P2POp]) -> None:
        if self._h2d is not None:  # staged units' copies land before NCCL reads the buffers
            torch.cuda.current_stream(self.device).wait_stream(self._h2d)
        if self.batched:
            # NCCL runs point-to-point operations in order on one stream, so a window's
            # receives and sends go out as one batch. A rank with nothing to do in a window
            # skips it, which torch allows only after the group's first collective: every
            # rank makes that one first, together.
            if i == 0:
                dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
            reqs = dist.batch_isend_irecv([*recvs, *sends]) if recvs or sends else []
        else:
            reqs = [op.op(op.tensor, op.peer, op.group, op.tag) for op in [*recvs, *sends]]
        with span("load.exchange", requests=len(reqs)), _transport("load's exchange", self.control):
            for req in reqs:
                req.wait()

    def _receives(self, window: list[ReadUnit], base: int) -> list[dist.P2POp]:
        ops = []
        for j, u in enumerate(window):
            if self.rank in u.receivers and u.nbytes:
                ops.append(dist.P2POp(dist.irecv, self._slice(u), self.global_rank(u.reader),
                                      self.group, base + j))
                self.bytes_received += u.nbytes
        return ops

    def _sends(self, u: ReadUnit, tag: int) -> list[dist.P2POp]:
        if not u.receivers or not u.nbytes:
            return []
        data = self._slice(u)
        return [dist.P2POp(dist.isend, data, self.global_rank(r), self.group, tag) for r in u.receivers]

    def _finish(self, window: list[ReadUnit]) -> None:
        done = {u.box: self.mine[u.box] for u in window
                if u.needed_by(self.rank) and self.mine[u.box].box is not None}
        devices = {c.target.data.device for read in done.values() for c in read.copies
                   if c.target.data.is_cuda}
        if self.device.type == "cuda":
            devices.add(self.device)
        with span("load.copy", boxes=len(done)):
            for read in done.values():
                try:
                    copy_out(read, non_blocking=True)
                except BaseException as exc:
                    self._fail(exc)
            for dev in devices:  # the copies complete before their buffers are reused or dropped
                with on_device(dev):
                    event = torch.cuda.Event(blocking=True)  # waits without spinning a core
                    event.record()
                    event.synchronize()
        for read in done.values():
            read.buffer = None  # boxes never span windows: this one is finished
