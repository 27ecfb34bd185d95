"""Host staging for saves: a reusable buffer pool and the copy of a rank's assigned boxes.

An async save must take a snapshot before training goes on, and a save of device tensors
needs host memory to write from. Both copy into one host arena per kind of memory (pinned
when the tensors are on CUDA, plain otherwise). The arena is allocated once, grows only when
a save needs more than any save before it, and is reused by every later save: saves run one
at a time, so it is never shared. Pieces are copied in write order, and each one is marked
ready as soon as it lands, so a writer may start on the first piece while the next ones are
still being copied (the two halves of a ping-pong pipeline, without a second copy). The
engine overlaps them for device tensors, where the copy is DMA; on CPU an async save lets the
copy finish first, since both would compete for the cores training is waiting on.

Every source's version counter is read when the stager is built (at ``save()``) and again
around its copy: a tensor changed in place before its copy landed fails the save with
``SnapshotChangedError`` instead of saving a mix of two states (see ``snapshot``).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from telemetry import span

from ..errors import SnapshotChangedError, StagingError
from ..runtime.devices import caller_device, cuda_devices, on_device

_ALIGN = 64  # every piece starts on a cache line, so any dtype view is aligned
# D2H copies queued under one CUDA event: a writer waiting for one piece waits at most for
# this much more of the DMA (~2 ms), and a 3.56 GB state needs ~60 events instead of ~800
EVENT_BYTES = 64 << 20


def _host_arena(nbytes: int) -> torch.Tensor:
    """Plain host memory for CPU snapshots, faulted in now rather than during the first copy.

    Anonymous memory populated by the kernel in one call (``MAP_POPULATE``): measured with 4
    ranks on this machine, 0.6 s per 0.9 GB against 0.75 s for touching every page, and the
    copies into it are steadier. Transparent huge pages (``MADV_HUGEPAGE``) were tried and
    dropped: with four ranks allocating at once, faulting them in took 6 s."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    try:
        region = mmap.mmap(-1, nbytes, flags=flags)
        arena = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    except (AttributeError, OSError, ValueError):  # no anonymous mmap here: plain allocation
        arena = torch.empty(nbytes, dtype=torch.uint8)
    if not getattr(mmap, "MAP_POPULATE", 0):
        arena.fill_(0)
    return arena


class HostBufferPool:
    """One growable host arena. ``reserve(n)`` returns the first ``n`` bytes of it.

    A pinned pool pins its own mmap arena with ``cudaHostRegister`` rather than asking
    PyTorch's pinned allocator, which rounds every block up to a power of two (a 20 GB save
    would pin 32 GB) and keeps a dropped block cached, still pinned, when the arena grows.
    The arena is unregistered before it is dropped, so its pages are unpinned before they are
    unmapped. When pinning fails the arena stays plain memory (copies are then synchronous)
    and the reason is kept in ``pin_failures`` and warned about: a save never fails for it."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._arena: torch.Tensor | None = None
        self._registered = False
        self._device: torch.device | None = None  # the device it was pinned on
        self.allocations = 0  # how many times memory was (re)allocated
        self.pin_failures: list[str] = []

    @property
    def capacity(self) -> int:
        return 0 if self._arena is None else self._arena.numel()

    @property
    def is_pinned(self) -> bool:
        return self._registered

    def reserve(self, nbytes: int, device: torch.device | None = None) -> torch.Tensor:
        """The first ``nbytes`` of the arena; a pinned pool that allocates pins it on ``device``
        (a CUDA device the copies' tensors live on)."""
        if self._arena is None or self._arena.numel() < nbytes:
            self._release()  # drop the old arena before allocating the larger one
            arena = _host_arena(max(nbytes, 1))
            if self.pinned:
                self._registered = self._pin(arena, device)
            self._arena = arena
            self.allocations += 1
        return self._arena[:nbytes]

    def bound(self, nbytes: int) -> None:
        """Drop the arena if it is larger than ``nbytes`` (a save with a staging cap must not
        keep an earlier, larger save's arena alive)."""
        if self.capacity > nbytes:
            self._release()

    def _pin(self, arena: torch.Tensor, device: torch.device | None) -> bool:
        # Registered on a device the tensors live on: on the thread's current device, a rank
        # that keeps its tensors on cuda:r without ``set_device`` would create a CUDA context
        # (hundreds of MiB) on GPU 0, one per rank of the host. The registration itself is
        # usable from every device.
        self._device = device
        try:
            with on_device(device):
                code = int(torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0))
            reason = None if code == 0 else f"cudaHostRegister returned CUDA error {code}"
        except Exception as exc:  # no CUDA runtime here
            reason = f"{type(exc).__name__}: {exc}"
        if reason is None:
            return True
        self.pin_failures.append(reason)
        warnings.warn(f"bytecheckpoint: could not pin {arena.numel()} bytes of host memory for "
                      f"staging ({reason}); using unpinned memory, so device copies are "
                      "synchronous", RuntimeWarning, stacklevel=4)
        return False

    def _release(self) -> None:
        if self._arena is not None and self._registered:
            with on_device(self._device):
                torch.cuda.cudart().cudaHostUnregister(self._arena.data_ptr())
        self._arena, self._registered = None, False


_POOLS: dict[tuple[bool, str], HostBufferPool] = {}
_POOLS_LOCK = threading.Lock()


def release_pools() -> None:
    """Drop every pool's arena (unpinned first); the next save or load allocates anew. Call
    it with no save or load in flight (``bcp.wait`` first), e.g. to measure memory."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for p in pools:
        p._release()


def pool(pinned: bool, purpose: str = "save") -> HostBufferPool:
    """The process's pool for ``purpose``: saves and loads keep separate arenas."""
    with _POOLS_LOCK:
        key = (pinned, purpose)
        if key not in _POOLS:
            _POOLS[key] = HostBufferPool(pinned)
        return _POOLS[key]


class _Flag:
    """A piece's "landed" flag: one condition shared by all pieces of a stager, where an
    Event per piece (a lock and a condition each) cost milliseconds per save to create."""

    __slots__ = ("_cond", "_set")

    def __init__(self, cond: threading.Condition) -> None:
        self._cond, self._set = cond, False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._cond:
            self._set = True
            self._cond.notify_all()

    def wait(self) -> None:
        if not self._set:
            with self._cond:
                self._cond.wait_for(self.is_set)


@dataclass
class StagedPiece:
    """A copy of one source tensor in the arena; ``bytes()`` waits until it has landed."""

    data: torch.Tensor  # uint8 slice of the arena
    _ready: _Flag
    _cuda_event: Any = None
    _device: torch.device | None = None  # of the event: waited on from any thread
    _failed: bool = False
    _error: BaseException | None = None

    @property
    def address(self) -> int | None:
        """Where the copy lands in the arena (host memory: pinned or not)."""
        return self.data.data_ptr() if self.data.numel() else None

    def __call__(self) -> memoryview:
        return self.bytes()

    def bytes(self) -> memoryview:
        self._ready.wait()
        if self._failed and isinstance(self._error, StagingError):
            raise self._error
        if self._failed:
            raise StagingError("staging the save's tensors into host memory failed; nothing "
                               f"from this save is written ({self._error or 'the save stopped'})"
                               ) from self._error
        if self._cuda_event is not None:
            with on_device(self._device):  # a writer thread may not be on the event's device
                self._cuda_event.synchronize()
        return memoryview(self.data.numpy()) if self.data.numel() else memoryview(b"")


def copy_groups(devices: list[Any], sizes: list[int], limit: int) -> Iterator[tuple[Any, list[int]]]:
    """Indexes of the sources in order, cut into runs on one device (``devices[i]``; None
    for host tensors) of at least ``limit`` bytes each (a device's last run may be smaller)."""
    group: list[int] = []
    device: Any = None
    nbytes = 0
    for i, (dev, size) in enumerate(zip(devices, sizes, strict=True)):
        if group and (dev != device or nbytes >= limit):
            yield device, group
            group, nbytes = [], 0
        device = dev
        group.append(i)
        nbytes += size
    if group:
        yield device, group


def settle_streams(sides: dict[torch.device, Any]) -> None:
    """Wait for everything queued on ``sides`` (a side stream per device) before a failed
    copy returns: its queued D2H copies would otherwise go on landing in an arena that a later
    save reuses. Called while an error propagates, so a failure of the wait itself is dropped:
    the first error is the one to raise."""
    for dev, side in sides.items():
        with torch.cuda.device(dev), contextlib.suppress(Exception):
            side.synchronize()


def _versions(tensors: tuple[torch.Tensor, ...]) -> tuple[int | None, ...]:
    """The tensors' version counters (bumped by every in-place write); None where a tensor
    has none (inference-mode tensors)."""
    out = []
    for t in tensors:
        try:
            out.append(t._version)
        except RuntimeError:
            out.append(None)
    return tuple(out)


class Stager:
    """Copies source views into the arena in order. ``plan`` sizes and places them first,
    so the writer can be handed every piece before the copies start.

    Built on the calling thread: it takes that thread's current device and, per source
    device, its current stream (both are per thread), so ``run`` on any thread copies after
    the caller's pending work on every device the sources live on."""

    def __init__(self, sources: list[torch.Tensor], names: list[str] | None = None,
                 owners: list[torch.Tensor] | None = None) -> None:
        self._init_common(sources, names, owners)
        offsets, total = [], 0
        for s in self.sources:
            offsets.append(total)
            total += -(-s.numel() * s.element_size() // _ALIGN) * _ALIGN
        arena = pool(self.cuda).reserve(total, self.pin_device)
        self.peak_bytes = total  # what this save stages into (the pool may hold more)
        landed = threading.Condition()
        self.pieces = [
            StagedPiece(arena[o : o + s.numel() * s.element_size()], _Flag(landed))
            for o, s in zip(offsets, self.sources)
        ]
        self.sources_for_writer = list(self.pieces)

    def _init_common(self, sources: list[torch.Tensor], names: list[str] | None,
                     owners: list[torch.Tensor] | None) -> None:
        # Only what autograd tracks needs detaching (a copy from it would record a graph);
        # detach() costs microseconds per tensor, every save.
        self.sources = [s.detach() if s.requires_grad else s for s in sources]
        self.names = names or [f"tensor piece {i}" for i in range(len(sources))]
        # A source is a plain view of the local shard, but a write to a DTensor bumps only the
        # wrapper's counter: the tensor of the state each piece comes from is watched as well.
        self._watched = [(s,) if owners is None else (s, o)
                         for s, o in zip(self.sources, owners or self.sources)]
        self.versions = [_versions(w) for w in self._watched]  # the state at save() time
        self.cuda = any(s.is_cuda for s in self.sources)
        self.device = caller_device() if self.cuda else None
        self.pin_device = next(iter(cuda_devices(self.sources)), None)  # where the arena is pinned
        # The caller's pending work on each source device, marked here, on its own thread, at
        # save(): the copy waits for exactly that. Waiting on the stream itself from the thread
        # that copies (an overlapped save's, later) would also wait for every kernel training
        # queued since, and the copy would no longer overlap the next step.
        self._caller_marks = {d: torch.cuda.current_stream(d).record_event()
                              for d in cuda_devices(self.sources)}
        self.error: BaseException | None = None
        self._cancelled = threading.Event()
        self.nbytes = sum(s.numel() * s.element_size() for s in self.sources)

    def run(self, on_queued: Any = None) -> None:
        """Copy every source; returns when the copies are done (on CUDA: synchronized).
        ``on_queued(events)``, on CUDA, gets each device's last copy event once every copy
        is queued."""
        try:
            with span("save.stage", bytes=self.nbytes, device="cuda" if self.cuda else "cpu"):
                if self.cuda:
                    with on_device(self.device):
                        self._run_cuda(on_queued)
                else:
                    for i, (src, piece) in enumerate(zip(self.sources, self.pieces)):
                        if self._cancelled.is_set():
                            break
                        self._check_unchanged(i)
                        if src.numel():
                            piece.data.view(src.dtype).view(src.shape).copy_(src)
                        self._check_unchanged(i)  # a write during the copy
                        piece._ready.set()
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.fail(self.error)  # pieces a cancel or an error left uncopied

    def _moved(self, i: int) -> bool:
        """Whether source ``i``'s version counter moved since save()."""
        return _versions(self._watched[i]) != self.versions[i]

    def changed(self) -> str | None:
        """The name of the first source whose version counter moved since save(), or None."""
        return next((self.names[i] for i in range(len(self._watched)) if self._moved(i)), None)

    def _check_unchanged(self, i: int) -> None:
        if self._moved(i):
            raise SnapshotChangedError(
                f"{self.names[i]} was changed in place before this async save had copied it, so "
                "the save would mix two training states; it is not committed. Call "
                "handle.wait_snapshot() before changing saved tensors outside optimizer.step() and "
                "module forward, or save with snapshot='blocking'")

    def _side_streams(self) -> dict[torch.device, Any]:
        """One copy stream per source device, each behind the caller's work at save()."""
        sides = {}
        for dev, mark in self._caller_marks.items():
            with torch.cuda.device(dev):
                sides[dev] = torch.cuda.Stream(dev)
                sides[dev].wait_event(mark)
        return sides

    def _run_cuda(self, on_queued: Any = None) -> None:
        # D2H on one side stream per source device, each first waiting for the caller's work
        # on that device at save(): a copy of a tensor on cuda:k runs on device k's current stream, so
        # a stream (and events) on any other device would neither wait for nor cover it.
        # record_stream keeps the caching allocator from reusing a source before its copy.
        # Copies are queued in groups (copy_groups), with one device/stream switch and one event
        # per group: the thread that queues them holds the GIL for their Python, and a training
        # loop that launches kernels from Python waits for it (on one H200, 808 copies of a
        # 3.56 GB state queued one by one with their own contexts and events took longer than
        # the DMA itself and stretched the save's step).
        sides = self._side_streams()
        try:
            last = self._queue_copies(sides)
            if on_queued is not None:  # from here training's writers only wait on these events,
                on_queued(dict(last))  # so their version bumps are sanctioned: no check after this
        except BaseException:
            settle_streams(sides)  # no queued copy may still be landing once the save has failed
            raise
        for dev, event in last.items():  # the snapshot is complete: training may change the tensors
            with torch.cuda.device(dev):
                event.synchronize()

    def _queue_copies(self, sides: dict[torch.device, Any]) -> dict[torch.device, Any]:
        """Queue every copy (or stop at a cancel); each device's last event."""
        last: dict[torch.device, Any] = {}
        devices = [src.device if src.is_cuda else None for src in self.sources]
        sizes = [src.numel() * src.element_size() for src in self.sources]
        for dev, group in copy_groups(devices, sizes, EVENT_BYTES):
            if self._cancelled.is_set():
                break
            if dev is None:  # host tensors among device ones: plain copies
                for i in group:
                    self._check_unchanged(i)
                    src = self.sources[i]
                    if src.numel():
                        self.pieces[i].data.view(src.dtype).view(src.shape).copy_(src)
                    self.pieces[i]._ready.set()
                continue
            side = sides[dev]
            with torch.cuda.device(dev), torch.cuda.stream(side):
                for i in group:
                    self._check_unchanged(i)
                    src = self.sources[i]
                    if src.numel():
                        src.record_stream(side)
                        self.pieces[i].data.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # waiters sleep instead of spinning
                event.record(side)
            for i in group:  # each piece's copy is covered by its group's event
                piece = self.pieces[i]
                piece._cuda_event, piece._device = event, dev
                piece._ready.set()
            last[dev] = event
        return last

    def cancel(self) -> None:
        """Stop before the next copy (the save failed; nobody will read the rest)."""
        self._cancelled.set()

    def fail(self, error: BaseException | None = None) -> None:
        """Release anyone waiting on pieces that will never be copied."""
        for piece in self.pieces:
            if not piece._ready.is_set():
                piece._failed, piece._error = True, error
                piece._ready.set()
