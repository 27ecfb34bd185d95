"""Splitting one large transfer into parts that run on a shared thread pool.

Backends use this for ranged reads of one file and for writes of large buffers at known
offsets. The pool is per process and never runs a task that waits on another task of the
same pool, so it cannot deadlock however many callers share it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .config import TransferSettings

_LOCK = threading.Lock()
_POOLS: dict[int, ThreadPoolExecutor] = {}


def pool(threads: int) -> ThreadPoolExecutor:
    with _LOCK:
        executor = _POOLS.get(threads)
        if executor is None:
            executor = _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="bcp-storage")
        return executor


def split(offset: int, length: int, part_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of consecutive parts covering ``[offset, offset + length)``."""
    return [(offset + s, min(part_bytes, length - s)) for s in range(0, length, part_bytes)] or [(offset, 0)]


def read_parts(
    read_part: Callable[[int, memoryview], int], offset: int, buffer: memoryview, transfer: TransferSettings
) -> int:
    """Fill ``buffer`` from ``offset`` with ``read_part(offset, view)`` calls, in parallel when
    the range spans more than one part. Returns the bytes read up to the first short part
    (end of file), like a single read would."""
    mv = memoryview(buffer).cast("B")
    # One contiguous span per thread (never below part_bytes): interleaved small parts make
    # every thread seek, and measured slower than one thread on a cold local disk.
    per_thread = -(-len(mv) // max(1, transfer.threads))
    parts = split(0, len(mv), max(transfer.part_bytes, per_thread))
    if len(parts) == 1 or not transfer.parallel:
        return read_part(offset, mv)
    futures = [pool(transfer.threads).submit(read_part, offset + s, mv[s : s + n]) for s, n in parts]
    got = [f.result() for f in _wait_all(futures)]
    total = 0
    for (_, n), g in zip(parts, got):
        total += g
        if g < n:
            break
    return total


def run_parts(tasks: list[Callable[[], None]], transfer: TransferSettings) -> None:
    """Run independent part transfers concurrently; raise the first error after all finish."""
    if len(tasks) == 1 or not transfer.parallel:
        for task in tasks:
            task()
        return
    for f in _wait_all([pool(transfer.threads).submit(task) for task in tasks]):
        f.result()


def _wait_all(futures: list[Future]) -> list[Future]:
    # Wait for every part before raising, so no part still writes into a buffer the caller
    # is about to reuse or free.
    for f in futures:
        f.exception()
    return futures
