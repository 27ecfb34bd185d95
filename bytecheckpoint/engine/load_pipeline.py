"""The read side of a load: every read unit is read once, by one rank, and sent to the others.

Units are processed in windows of about ``window_bytes``. For each window a rank posts
receives for the units others read for it, reads its own units on a thread pool (ranged,
verified), sends them to the ranks that need them, and copies finished boxes into the target
tensors. Reading the next window overlaps the exchange and copies of this one. Every rank
runs the same windows in the same order, so the point-to-point messages always pair up; a
failed read is remembered and raised after the exchange, so no rank is left waiting.

On CPU the exchange runs over the gloo control group with host buffers. When the targets
live on CUDA and the training group is NCCL, buffers live on the device and the units go
over NCCL (read into pinned memory, then one H2D copy per unit).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from telemetry import span

from ..checksums import bad_chunks
from ..errors import CorruptCheckpointError
from ..planners import LocalShard
from ..sharding import Box, element_span, row_major_strides
from ..storage import Storage
from .read_plan import ReadUnit, windows

DEFAULT_WINDOW_BYTES = 256 << 20


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


def direct_target(read: BoxRead) -> torch.Tensor | None:
    """The target's own bytes when the needed range lands in one contiguous CPU view."""
    if read.box is None or len(read.copies) != 1:
        return None
    c = read.copies[0]
    dst = c.target.data[c.region.relative_to(c.target.box).slices()]
    first, end = element_span(c.region.relative_to(read.box), read.box.lengths)
    item = read.dtype.itemsize
    exact = (first * item, end * item) == (read.lo, read.hi) and (end - first) == c.region.numel
    if not exact or dst.device.type != "cpu" or not dst.is_contiguous() or dst.dtype != read.dtype:
        return None
    return dst.reshape(-1).view(torch.uint8)


def copy_out(read: BoxRead, non_blocking: bool = False) -> None:
    """Copy each needed region of a filled box buffer into its target view."""
    if read.direct is not None or read.box is None:
        return
    assert read.buffer is not None
    item = read.dtype.itemsize
    values = read.buffer.view(read.dtype) if read.buffer.numel() else torch.empty(0, dtype=read.dtype)
    base = read.lo // item
    strides = row_major_strides(read.box.lengths)
    for c in read.copies:
        rel = c.region.relative_to(read.box)
        first, _ = element_span(rel, read.box.lengths)
        src = values.as_strided(rel.lengths, strides, first - base)
        dst = c.target.data[c.region.relative_to(c.target.box).slices()]
        if dst.device.type == "cuda" and src.device.type == "cpu":
            with span("load.h2d", bytes=c.region.numel * item):
                dst.copy_(src, non_blocking=non_blocking)
        else:
            dst.copy_(src)


def contiguous_runs(units: list[tuple[int, ReadUnit]], limit: int) -> list[list[tuple[int, ReadUnit]]]:
    """Split ``(index, unit)`` pairs (in file order) into runs of units that lie back to back
    in one file, each at most ``limit`` bytes unless one unit alone is larger. A run is one
    sequential read: a checkpoint of many small tensors is read in a few large requests."""
    runs: list[list[tuple[int, ReadUnit]]] = []
    end, size, file = -1, 0, -1
    for j, u in units:
        start = u.box_offset + u.start
        if runs and u.file == file and start == end and size + u.nbytes <= limit:
            runs[-1].append((j, u))
            size += u.nbytes
        else:
            runs.append([(j, u)])
            size = u.nbytes
        end, file = u.box_offset + u.stop, u.file
    return runs


@dataclass
class PipelineResult:
    bytes_read: int
    bytes_received: int
    error: BaseException | None


class LoadPipeline:
    """Runs the read units of one load on this rank (see the module docstring)."""

    def __init__(self, storage: Storage, path: str, units: list[ReadUnit],
                 mine: dict[tuple[int, int], BoxRead], *, rank: int, group: Any,
                 global_rank: Callable[[int], int], threads: int, verify: bool, chunk_bytes: int,
                 device: torch.device, window_bytes: int = DEFAULT_WINDOW_BYTES) -> None:
        self.storage, self.path = storage, path
        self.units, self.mine, self.rank = units, mine, rank
        self.group, self.global_rank = group, global_rank
        self.threads, self.verify, self.chunk_bytes = threads, verify, chunk_bytes
        self.device = device
        self.window_bytes = window_bytes
        self.error: BaseException | None = None
        self.bytes_read = 0
        self.bytes_received = 0

    # -- buffers -----------------------------------------------------------------------
    def _allocate(self, window: list[ReadUnit]) -> None:
        for u in window:
            read = self.mine.get(u.box)
            if read is None or read.buffer is not None or not u.needed_by(self.rank):
                continue
            if read.direct is not None:
                read.buffer = read.direct
            else:
                read.buffer = torch.empty(read.hi - read.lo, dtype=torch.uint8, device=self.device)

    def _slice(self, u: ReadUnit) -> torch.Tensor:
        read = self.mine[u.box]
        assert read.buffer is not None
        return read.buffer[u.start - read.lo : u.stop - read.lo]

    # -- reading -------------------------------------------------------------------------
    def _read(self, units: list[ReadUnit]) -> None:
        """Read units that lie back to back in one file with one request, then check each."""
        first = self.mine[units[0].box]
        full = posixpath.join(self.path, first.file)
        offset = units[0].box_offset + units[0].start
        targets = []
        for u in units:
            dst = self._slice(u)
            host = dst if dst.device.type == "cpu" else torch.empty(
                u.nbytes, dtype=torch.uint8, pin_memory=True)
            targets.append((u, dst, host, memoryview(host.numpy()) if u.nbytes else memoryview(b"")))
        with span("load.read", path=full, bytes=sum(u.nbytes for u in units)):
            if len(targets) == 1:  # one large range: the backend splits it over threads
                got = self.storage.read_into(full, offset, targets[0][3])
            else:
                got = self.storage.read_into_many(full, offset, [t[3] for t in targets])
        for u, dst, host, view in targets:
            have, got = max(0, min(got, u.nbytes)), got - u.nbytes
            self._check(u, full, view, have)
            if host is not dst:
                with span("load.h2d", bytes=u.nbytes):
                    dst.copy_(host, non_blocking=True)
                    torch.cuda.current_stream(dst.device).synchronize()

    def _check(self, u: ReadUnit, full: str, view: memoryview, got: int) -> None:
        read = self.mine[u.box]
        if got != u.nbytes:
            raise CorruptCheckpointError(
                f"{self.storage.url(full)}: truncated: wanted {u.nbytes} bytes at "
                f"{read.byte_offset + u.start}, got {got}"
            )
        aligned = u.start % self.chunk_bytes == 0 and (
            u.stop % self.chunk_bytes == 0 or u.stop == read.byte_length)
        if self.verify and aligned and bad_chunks(view, u.start, list(read.checksums), self.chunk_bytes):
            raise CorruptCheckpointError(
                f"{self.storage.url(full)}: checksum mismatch in {read.key} (bytes "
                f"{read.byte_offset + u.start}..{read.byte_offset + u.stop}); the file is "
                "corrupt: restore it or load another checkpoint"
            )

    def _submit(self, pool: ThreadPoolExecutor,
                window: list[ReadUnit]) -> list[tuple[int, ReadUnit, Future]]:
        self._allocate(window)
        mine = [(j, u) for j, u in enumerate(window) if u.reader == self.rank]
        limit = max(1, self.window_bytes // max(1, self.threads))
        out = []
        for run in contiguous_runs(mine, limit):
            future = pool.submit(self._read, [u for _, u in run])
            out.extend((j, u, future) for j, u in run)
        return out

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> PipelineResult:
        groups = windows(self.units, self.window_bytes)
        bases = [0]
        for g in groups:
            bases.append(bases[-1] + len(g))  # tags: the unit's index in the whole plan
        with ThreadPoolExecutor(max(1, self.threads)) as pool:
            pending = self._submit(pool, groups[0]) if groups else []
            for i, window in enumerate(groups):
                # gloo: receives are posted before reading, sends as reads complete. NCCL
                # runs point-to-point operations in order on one stream, so a window's
                # receives and sends go out together as one batch instead.
                batched = self.device.type == "cuda"
                recvs = self._receives(window, bases[i])
                reqs = [] if batched else [op.op(op.tensor, op.peer, op.group, op.tag) for op in recvs]
                reads = pending
                pending = self._submit(pool, groups[i + 1]) if i + 1 < len(groups) else []
                sends = []
                for j, u, fut in reads:
                    try:
                        fut.result()
                        self.bytes_read += u.nbytes
                    except Exception as exc:  # still send: the peers are waiting for these bytes
                        self._fail(exc)
                    ops = self._sends(u, bases[i] + j)
                    if batched:
                        sends.extend(ops)
                    else:
                        reqs.extend(op.op(op.tensor, op.peer, op.group, op.tag) for op in ops)
                if batched and (recvs or sends):
                    reqs = dist.batch_isend_irecv([*recvs, *sends])
                with span("load.exchange", requests=len(reqs)):
                    for req in reqs:
                        req.wait()
                self._finish(window)
        return PipelineResult(self.bytes_read, self.bytes_received, self.error)

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
        with span("load.copy", boxes=len(done)):
            for read in done.values():
                try:
                    copy_out(read, non_blocking=self.device.type == "cuda")
                except Exception as exc:
                    self._fail(exc)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        for read in done.values():
            read.buffer = None  # boxes never span windows: this one is finished
