"""A staging arena smaller than the rank's share: the copy runs in arena-sized rounds.

``BCP_STAGING_MAX_BYTES`` (or ``save(..., staging_max_bytes=)``) bounds the host memory an
async save (or a save of device tensors) stages into. When the rank's share fits, nothing
changes (``staging.Stager``). When it does not, ``CappedStager`` copies the pieces, cut into
segments, into a ring of that many bytes, and a segment's memory is reused only after the
writer has written it: the copy waits for the writer, so it takes about as long as the
write instead of a memory copy. The snapshot is still the state at ``save()``: the version
counters are checked around every piece, as in ``staging``.

Segments are multiples of the checksum chunk (the writer checksums each block as it comes),
and the copy follows the order the writers consume pieces in (kind by kind, plan order
within a kind), so the ring never waits for a segment no writer will take next.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from telemetry import span

from ..errors import InvalidArgumentError, InvalidSettingError, StagingError
from ..format.boxes import flat_range_boxes
from ..runtime.devices import on_device
from .staging import EVENT_BYTES, Stager, pool, settle_streams

_ALIGN = 64
SETTING = "BCP_STAGING_MAX_BYTES"


def staging_cap(value: int | None = None) -> int | None:
    """The arena bound: ``value`` if given, else ``BCP_STAGING_MAX_BYTES``; None: unbounded."""
    if value is None:
        raw = os.environ.get(SETTING, "").strip()
        if not raw:
            return None
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value <= 0:  # the variable, by name (the argument's message below is for save())
            raise InvalidSettingError(f"{SETTING} = {raw!r} is not a positive whole number of bytes: "
                                      "unset it or give the most host memory a save may stage into")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"staging_max_bytes = {value!r} is not a positive number of bytes: "
                                   "give the most host memory a save may stage into, or leave it unset")
    return value


class _Cancelled(Exception):
    pass


class _Ring:
    """First in, first out allocation in a fixed arena; ``alloc`` waits for space."""

    def __init__(self, capacity: int, cancelled: threading.Event) -> None:
        self.capacity = capacity
        self._cancelled = cancelled
        self._cond = threading.Condition()
        self._live: deque[list[Any]] = deque()  # [start, end, released], monotonic offsets
        self._head = 0
        self.peak = 0  # the most bytes of the arena in use at once (wrap-around waste counted)

    def alloc(self, nbytes: int) -> tuple[int, list[Any]]:
        """An arena offset and a slot for ``nbytes``, waiting for releases while it is full."""
        with self._cond:
            while (got := self._take(nbytes)) is None:
                if self._cancelled.is_set():
                    raise _Cancelled
                self._cond.wait()
            return got

    def try_alloc(self, nbytes: int) -> tuple[int, list[Any]] | None:
        """``alloc`` where it would not wait; None where it would."""
        with self._cond:
            return self._take(nbytes)

    def _take(self, nbytes: int) -> tuple[int, list[Any]] | None:
        need = -(-nbytes // _ALIGN) * _ALIGN
        pos = self._head % self.capacity
        start = self._head if pos + need <= self.capacity else self._head + self.capacity - pos
        tail = self._live[0][0] if self._live else start
        if start + need - tail > self.capacity:
            return None
        seg = [start, start + need, False]
        self._live.append(seg)
        self._head = start + need
        self.peak = max(self.peak, self._head - tail)
        return start % self.capacity, seg

    def release(self, seg: list[Any]) -> None:
        with self._cond:
            seg[2] = True
            while self._live and self._live[0][2]:
                self._live.popleft()
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class _Segment:
    """Elements [start, stop) of one source, once copied into the ring."""

    __slots__ = ("start", "stop", "data", "slot", "ready", "event", "device", "failed", "error")

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop
        self.data: torch.Tensor | None = None
        self.slot: list[Any] | None = None
        self.ready = threading.Event()
        self.event: Any = None
        self.device: torch.device | None = None
        self.failed = False
        self.error: BaseException | None = None


class _Group:
    """The segments copied since the group was last closed, all from one device (``device``;
    None: host memory). CUDA segments are covered by one event recorded on the device's side
    stream when the group closes; host segments, copied already, are grouped the same way so
    that every save runs this logic (a CPU test catches what would hang on a GPU)."""

    def __init__(self, sides: dict[torch.device, Any], last: dict[torch.device, Any]) -> None:
        self._sides, self._last = sides, last
        self.device: torch.device | None = None
        self._segments: list[_Segment] = []
        self._bytes = 0

    def add(self, seg: _Segment, nbytes: int, limit: int) -> None:
        self._segments.append(seg)
        self._bytes += nbytes
        if self._bytes >= limit:
            self.close()

    def close(self) -> None:
        """Record one event after the group's copies (CUDA) and hand its segments to the writers."""
        if not self._segments:
            return
        event = None
        if self.device is not None:
            with torch.cuda.device(self.device):
                event = torch.cuda.Event(blocking=True)  # waiters sleep instead of spinning
                event.record(self._sides[self.device])
            self._last[self.device] = event
        for seg in self._segments:
            seg.event, seg.device = event, self.device
            seg.ready.set()
        self._segments, self._bytes = [], 0


class RingPiece:
    """A writer's source for one piece: ``parts()`` yields its segments as they land and
    gives each one's memory back to the ring once the writer asks for the next."""

    def __init__(self, stager: CappedStager, index: int) -> None:
        self._stager, self._index = stager, index

    def __call__(self) -> memoryview:
        raise StagingError("a piece staged through a bounded arena is read in parts only; this "
                           "save path cannot use BCP_STAGING_MAX_BYTES: unset it")

    def parts(self, block: int = 0) -> Iterator[memoryview]:
        """The segments as they land (their size is the ring's; ``block`` is not used)."""
        ring = self._stager.ring
        for seg in self._stager.segments[self._index]:
            seg.ready.wait()
            if seg.failed:
                if isinstance(seg.error, StagingError):
                    raise seg.error
                raise StagingError("staging the save's tensors into host memory failed; nothing "
                                   f"from this save is written ({seg.error or 'the save stopped'})"
                                   ) from seg.error
            try:
                if seg.event is not None:
                    with on_device(seg.device):
                        seg.event.synchronize()
                assert seg.data is not None
                yield memoryview(seg.data.numpy()) if seg.data.numel() else memoryview(b"")
            finally:
                if seg.slot is not None:
                    ring.release(seg.slot)


class CappedStager(Stager):
    """``Stager`` through a ring of ``capacity`` bytes (less than the pieces need)."""

    def __init__(self, sources: list[torch.Tensor], names: list[str], owners: list[torch.Tensor],
                 capacity: int, chunk_bytes: int, order: list[int]) -> None:
        self._init_common(sources, names, owners)
        capacity = capacity // _ALIGN * _ALIGN
        self.order = order  # copy order: the writers' consumption order
        self.segments: list[list[_Segment]] = []
        for s in self.sources:
            size = s.element_size()
            unit = math.lcm(chunk_bytes, size)  # a segment is whole chunks and whole elements
            seg_bytes = (capacity // 4) // unit * unit or capacity // unit * unit
            if seg_bytes == 0 and s.numel() * size > capacity:
                raise StagingError(f"{SETTING} = {capacity} bytes is smaller than one checksum chunk "
                                   f"({chunk_bytes} bytes) of {s.dtype}: raise it to at least "
                                   f"{unit} bytes (better several chunks), or save with smaller chunk_bytes")
            step = max(1, (seg_bytes or capacity) // size)
            n = s.numel()
            self.segments.append([_Segment(a, min(n, a + step)) for a in range(0, n, step)] or
                                 [_Segment(0, 0)])
        pool(self.cuda).bound(capacity)
        self.ring = _Ring(capacity, self._cancelled)
        # a group holds at most a quarter of the ring, so writers start early
        self.group_bytes = max(_ALIGN, min(EVENT_BYTES, capacity // 4))
        self._arena = pool(self.cuda).reserve(capacity, self.pin_device)
        self.pieces = []
        self.sources_for_writer = [RingPiece(self, i) for i in range(len(self.sources))]

    @property
    def peak_bytes(self) -> int:
        """The most bytes of the ring in use at once (at most its capacity)."""
        return self.ring.peak

    def run(self, on_queued: Any = None) -> None:
        try:
            with span("save.stage", bytes=self.nbytes, device="cuda" if self.cuda else "cpu",
                      capped=self.ring.capacity):
                with on_device(self.device):
                    self._run(on_queued)
        except _Cancelled:
            pass
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.fail(self.error)

    def _run(self, on_queued: Any) -> None:
        sides = self._side_streams() if self.cuda else {}
        try:
            last = self._queue_copies(sides)
            if on_queued is not None:
                on_queued(dict(last))
        except BaseException:  # a cancel too: the ring's memory goes back to the pool
            settle_streams(sides)  # with no queued copy still landing in it
            raise
        for dev, event in last.items():
            with torch.cuda.device(dev):
                event.synchronize()

    def _queue_copies(self, sides: dict[torch.device, Any]) -> dict[torch.device, Any]:
        """Copy (on CUDA: queue) every segment as ring memory frees up; each device's last event.

        As in ``Stager``, CUDA copies are queued in groups: one event and one device/stream
        switch per group rather than per segment (the queuing thread's Python competes with a
        launch-bound training loop for the GIL). Host copies are grouped alike, without an
        event. A group is closed when it reaches ``group_bytes`` and, always, before an
        allocation would wait for ring memory: the writers that free it wait for their
        segments to be handed over, so every copied segment is handed over before the copier
        sleeps.
        """
        last: dict[torch.device, Any] = {}
        group = _Group(sides, last)
        with contextlib.ExitStack() as switch:
            for i in self.order:
                src = self.sources[i]
                self._check_unchanged(i)
                device = src.device if src.is_cuda else None
                if device != group.device:
                    group.close()
                    group.device = device
                    if device is not None:
                        switch.close()
                        switch.enter_context(torch.cuda.device(device))
                        switch.enter_context(torch.cuda.stream(sides[device]))
                if device is not None:
                    src.record_stream(sides[device])
                for seg in self.segments[i]:
                    if self._cancelled.is_set():
                        raise _Cancelled
                    nbytes = (seg.stop - seg.start) * src.element_size()
                    got = self.ring.try_alloc(nbytes)
                    if got is None:  # full: cover what is queued, then wait for the writers
                        group.close()
                        got = self.ring.alloc(nbytes)
                    offset, seg.slot = got
                    seg.data = self._arena[offset : offset + nbytes]
                    _copy_range(src, seg, non_blocking=device is not None)
                    group.add(seg, nbytes, self.group_bytes)
                if device is None:
                    self._check_unchanged(i)  # a write during the copy
            group.close()
        return last

    def cancel(self) -> None:
        super().cancel()
        self.ring.wake()

    def fail(self, error: BaseException | None = None) -> None:
        for segs in self.segments:
            for seg in segs:
                if not seg.ready.is_set():
                    seg.failed, seg.error = True, error
                    seg.ready.set()


def _copy_range(src: torch.Tensor, seg: _Segment, non_blocking: bool = False) -> None:
    """Copy elements [seg.start, seg.stop) of ``src`` (row-major) into ``seg.data``."""
    if seg.stop == seg.start:
        return
    dst = seg.data.view(src.dtype)
    if src.is_contiguous():
        dst.copy_(src.reshape(-1)[seg.start : seg.stop], non_blocking=non_blocking)
        return
    pos = 0
    for box in flat_range_boxes(tuple(src.shape), seg.start, seg.stop):
        view = src[box.slices()]
        n = view.numel()
        dst[pos : pos + n].view(view.shape).copy_(view, non_blocking=non_blocking)
        pos += n
