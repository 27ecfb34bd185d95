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
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass

import torch

from telemetry import span

_ALIGN = 64  # every piece starts on a cache line, so any dtype view is aligned


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
    """One growable host arena. ``reserve(n)`` returns the first ``n`` bytes of it."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._arena: torch.Tensor | None = None
        self.allocations = 0  # how many times memory was (re)allocated

    @property
    def capacity(self) -> int:
        return 0 if self._arena is None else self._arena.numel()

    def reserve(self, nbytes: int) -> torch.Tensor:
        if self._arena is None or self._arena.numel() < nbytes:
            self._arena = None  # drop the old arena before allocating the larger one
            size = max(nbytes, 1)
            if self.pinned:
                self._arena = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            else:
                self._arena = _host_arena(size)
            self.allocations += 1
        return self._arena[:nbytes]


_POOLS: dict[bool, HostBufferPool] = {}
_POOLS_LOCK = threading.Lock()


def pool(pinned: bool) -> HostBufferPool:
    with _POOLS_LOCK:
        if pinned not in _POOLS:
            _POOLS[pinned] = HostBufferPool(pinned)
        return _POOLS[pinned]


@dataclass
class StagedPiece:
    """A copy of one source tensor in the arena; ``bytes()`` waits until it has landed."""

    data: torch.Tensor  # uint8 slice of the arena
    _ready: threading.Event
    _cuda_event: object | None = None
    _failed: bool = False

    def bytes(self) -> memoryview:
        self._ready.wait()
        if self._failed:
            raise RuntimeError("staging the save's tensors into host memory failed; nothing "
                               "from this save is written")
        if self._cuda_event is not None:
            self._cuda_event.synchronize()  # type: ignore[attr-defined]
        return memoryview(self.data.numpy()) if self.data.numel() else memoryview(b"")


class Stager:
    """Copies source views into the arena in order. ``plan`` sizes and places them first,
    so the writer can be handed every piece before the copies start."""

    def __init__(self, sources: list[torch.Tensor]) -> None:
        self.sources = [s.detach() for s in sources]
        self.cuda = any(s.is_cuda for s in self.sources)
        offsets, total = [], 0
        for s in self.sources:
            offsets.append(total)
            total += -(-s.numel() * s.element_size() // _ALIGN) * _ALIGN
        self.nbytes = sum(s.numel() * s.element_size() for s in self.sources)
        arena = pool(self.cuda).reserve(total)
        self.pieces = [
            StagedPiece(arena[o : o + s.numel() * s.element_size()], threading.Event())
            for o, s in zip(offsets, self.sources)
        ]

    def run(self) -> None:
        """Copy every source; returns when the copies are done (on CUDA: synchronized)."""
        with span("save.stage", bytes=self.nbytes, device="cuda" if self.cuda else "cpu"):
            if self.cuda:
                self._run_cuda()
            else:
                for src, piece in zip(self.sources, self.pieces):
                    if src.numel():
                        piece.data.view(src.dtype).view(src.shape).copy_(src)
                    piece._ready.set()

    def _run_cuda(self) -> None:
        # D2H on a side stream that first waits for the training stream's pending work;
        # record_stream keeps the caching allocator from reusing a source before its copy.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        last = None
        with torch.cuda.stream(side):
            for src, piece in zip(self.sources, self.pieces):
                if src.numel():
                    if src.is_cuda:
                        src.record_stream(side)
                    piece.data.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
                piece._cuda_event, last = event, event
                piece._ready.set()
        if last is not None:
            last.synchronize()  # the snapshot is complete: training may change the tensors

    def fail(self) -> None:
        """Release anyone waiting on pieces that will never be copied."""
        for piece in self.pieces:
            if not piece._ready.is_set():
                piece._failed = True
                piece._ready.set()
