"""Hold Python's cyclic garbage collector off while a save, a load or global planning runs.

A save allocates tens of thousands of small objects (boxes, plan items, views). With the
collector on, they live just long enough to be promoted, which triggers full collections
over the whole training process's heap: 150-270 ms pauses on one rank, measured on a 300M
model, and since a save is collective every other rank waits for it. With the collector off
for the save, those objects are freed by reference counting before any collection sees
them, so the pauses are not moved later but avoided. ``BCP_GC_PAUSE=0`` turns this off.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_LOCK = threading.Lock()
_DEPTH = 0  # nested or concurrent pauses: the last one out re-enables
_WE_DISABLED = False


def _enabled() -> bool:
    """``BCP_GC_PAUSE``: 0 (or false, off, no) keeps the collector running. Any other unknown
    value keeps the default with a warning, once: this runs inside metadata decoding, where an
    error would read as a damaged checkpoint."""
    raw = os.environ.get("BCP_GC_PAUSE", "").strip().lower()
    if raw in ("0", "false", "off", "no"):
        return False
    if raw not in ("", "1", "true", "on", "yes") and raw not in _WARNED:
        _WARNED.add(raw)
        logging.getLogger(__name__).warning(
            "BCP_GC_PAUSE = %r is neither 1 nor 0; pausing the garbage collector (the default)", raw)
    return True


_WARNED: set[str] = set()


def hold() -> Callable[[], None]:
    """Pause the collector until the returned function is called (once; from any thread).
    An overlapped save holds it from its foreground part until its copy is done, so the
    collection of what the save allocated runs on the save's thread, not in ``save()``."""
    if not _enabled():
        return lambda: None
    global _DEPTH, _WE_DISABLED
    with _LOCK:
        if _DEPTH == 0:
            # Leave a collector the training script turned off (manual GC) as it is.
            _WE_DISABLED = gc.isenabled()
            gc.disable()
        _DEPTH += 1
    released = threading.Event()

    def release() -> None:
        global _DEPTH, _WE_DISABLED
        with _LOCK:
            if released.is_set():
                return
            released.set()
            _DEPTH -= 1
            if _DEPTH == 0 and _WE_DISABLED:
                _WE_DISABLED = False
                gc.enable()

    return release


@contextmanager
def gc_paused() -> Iterator[None]:
    release = hold()
    try:
        yield
    finally:
        release()
