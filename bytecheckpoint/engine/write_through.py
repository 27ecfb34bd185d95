"""An overlapped snapshot of host tensors with no staging copy: the write is the copy.

An overlapped save of CPU tensors to storage whose ``write()`` returns once the bytes are
copied into memory the OS writes back later (a local disk's page cache; see
``Storage.buffered_writes``) needs no arena: the writer writes straight from the live
tensors, and the snapshot is complete once the last piece has gone through ``write()``. That
saves one memory copy of the rank's share per save (its CPU time and its memory traffic, on
cores training needs) and the arena itself (one copy of the share in host memory).

The guarantees are the arena's: the optimizer step hook waits until every piece is written,
the version counters are checked around each piece and confirmed before the commit, and a
write that breaks the rule fails the save by name. The price: training's next optimizer step
waits for the write into the page cache instead of a memory copy, so where the disk cannot
keep up (the page cache's dirty limit is reached) the step may wait longer. Modules with
buffers wait in forward (see ``snapshot``), so a state with one uses the arena instead.
``BCP_SNAPSHOT_WRITE_THROUGH=0`` always uses the arena.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import InvalidSettingError, StagingError
from ..format.dtypes import byte_view
from ..storage import Storage
from .staging import Stager

SETTING = "BCP_SNAPSHOT_WRITE_THROUGH"


def enabled() -> bool:
    """``BCP_SNAPSHOT_WRITE_THROUGH``: ``1`` (the default) lets overlapped saves write through,
    ``0`` keeps the arena; anything else is refused by name (a typo must not pick for you)."""
    raw = os.environ.get(SETTING, "").strip()
    if raw not in ("", "0", "1"):
        raise InvalidSettingError(f"{SETTING}={raw!r} must be 1 (write overlapped saves of host "
                                   "tensors straight from them) or 0 (copy into the staging arena "
                                   "first); nothing was saved")
    return raw != "0"


def applies(views: list[torch.Tensor], storage: Storage, forward_waits: bool,
            files_per_host: bool) -> bool:
    """Whether an overlapped save of ``views`` may skip the arena: host tensors only, a storage
    whose writes land in memory, no saved module whose forward waits for the snapshot
    (``forward_waits``: one with buffers), ``files_per="rank"`` (a host member streams its
    pieces to its leader)."""
    return (enabled() and not files_per_host and not forward_waits and storage.buffered_writes
            and all(v.device.type == "cpu" for v in views))


class WriteThroughStager(Stager):
    """``Stager``'s interface with nothing staged: each writer source reads its live tensor.

    The function given to ``when_done`` runs once: when the last piece has been written (the
    snapshot is complete), or when the write ends or stops another way (``finish``,
    ``cancel``, ``fail``: training never waits for a save that is over)."""

    def __init__(self, sources: list[torch.Tensor], names: list[str], owners: list[torch.Tensor]) -> None:
        self._init_common(sources, names, owners)
        self.peak_bytes = 0
        self.pieces = []
        self._lock = threading.Lock()
        self._left = len(self.sources)
        self._on_done: Callable[[], None] | None = None
        self._fired = False
        self.sources_for_writer = [LivePiece(self, i) for i in range(len(self.sources))]

    def when_done(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the snapshot is complete (at once if it already is)."""
        with self._lock:
            self._on_done = fn
            fire = self._left == 0
        if fire:
            self._fire()

    def finish(self) -> None:
        """The write is over (or stopped): training need not wait any longer."""
        self._fire()

    def _fire(self) -> None:
        with self._lock:
            if self._fired or self._on_done is None:
                return
            self._fired = True
            fn = self._on_done
        fn()

    def _written(self) -> None:
        with self._lock:
            self._left -= 1
            fire = self._left == 0
        if fire:
            self._fire()

    def run(self, on_queued: Any = None) -> None:
        """Nothing to copy ahead of the writer."""

    def cancel(self) -> None:
        super().cancel()
        self._fire()

    def fail(self, error: BaseException | None = None) -> None:
        self.error = self.error or error
        self._fire()


class LivePiece:
    """A writer's source for one live tensor: ``parts(block)`` checks the tensor's counter,
    yields its bytes in blocks of ``block`` bytes (whole checksum chunks), and checks the
    counter again once the writer asks past the last block (the writer has written it by
    then)."""

    def __init__(self, stager: WriteThroughStager, index: int) -> None:
        self._stager, self._index = stager, index

    @property
    def address(self) -> int | None:
        """Where the bytes lie (a contiguous tensor's own memory), for the file's layout."""
        src = self._stager.sources[self._index]
        return src.data_ptr() if src.is_contiguous() and src.device.type == "cpu" else None

    def __call__(self) -> memoryview:
        raise StagingError("a piece written through from its live tensor is read in parts only; "
                           f"this save path cannot use it: set {SETTING}=0")

    def parts(self, block: int) -> Iterator[memoryview]:
        stager, i = self._stager, self._index
        if stager._cancelled.is_set():
            raise StagingError("this save stopped before writing its tensors; nothing from it is committed")
        stager._check_unchanged(i)
        src = stager.sources[i]
        if src.numel():
            # A non-contiguous view is copied here, on the writer thread: that copy is then
            # this piece's snapshot, taken before the piece counts as written.
            data = memoryview(byte_view(src.contiguous()).numpy())
            for start in range(0, len(data), block):
                yield data[start : start + block]
        stager._check_unchanged(i)  # a write while the piece went out
        stager._written()
