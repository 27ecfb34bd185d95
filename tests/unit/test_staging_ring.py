"""The bounded staging arena's allocator (``staging_ring._Ring``): a bounded save copies each
segment into the memory ``alloc`` hands out while writers still read earlier segments, so two
live segments that overlap would put one segment's bytes into another's file, checksummed
after the fact and never noticed."""

from __future__ import annotations

import threading

import torch
from hypothesis import given
from hypothesis import strategies as st

from bytecheckpoint.engine import staging
from bytecheckpoint.engine.staging_ring import CappedStager, _Cancelled, _Ring
from tests.fuzz.strategies import fuzz_settings

# A step: allocate this many bytes, or release the live segment at this index (writers on
# several files release out of allocation order).
_STEPS = st.lists(st.one_of(st.tuples(st.just("alloc"), st.integers(0, 300)),
                            st.tuples(st.just("release"), st.integers(0, 50))), max_size=80)


@given(st.integers(1, 16).map(lambda k: 64 * k), _STEPS)
@fuzz_settings(300)
def test_live_segments_never_overlap_and_a_drained_ring_always_has_room(capacity, steps):
    cancelled = threading.Event()
    cancelled.set()  # alloc raises _Cancelled where it would wait for a release
    ring = _Ring(capacity, cancelled)
    live: list[tuple[int, int, list]] = []  # (offset in the arena, bytes, slot)
    for op, n in steps:
        if op == "release":
            if live:
                ring.release(live.pop(n % len(live))[2])
            continue
        need = min(n, capacity)
        got = ring.try_alloc(need)
        if got is not None:
            offset, slot = got
        else:  # full: alloc would wait, and once every live segment is released it must fit
            try:
                ring.alloc(need)
                raise AssertionError(f"try_alloc refused {need} bytes that alloc then handed out")
            except _Cancelled:
                pass
            assert live, f"an empty ring of {capacity} bytes refused {need}"
            for _, _, slot in live:
                ring.release(slot)
            live.clear()
            offset, slot = ring.alloc(need)
        assert 0 <= offset and offset + need <= capacity, (offset, need, capacity)
        for other, m, _ in live:
            assert offset + need <= other or other + m <= offset, (offset, need, other, m)
        live.append((offset, need, slot))
        assert ring.peak <= capacity


def test_a_waiting_alloc_resumes_when_the_oldest_segment_is_released():
    ring = _Ring(256, threading.Event())
    _, first = ring.alloc(128)
    ring.alloc(128)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(ring.alloc(64)[0]))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # full: it waits
    ring.release(first)
    waiter.join(5)
    assert got == [0]  # the first segment's memory, now free


def test_try_alloc_answers_at_once_where_alloc_would_wait():
    ring = _Ring(256, threading.Event())
    _, first = ring.alloc(190)  # 192 bytes, aligned
    assert ring.try_alloc(100) is None  # would wait: nothing is taken
    assert ring.try_alloc(64) is not None  # fits beside the first
    assert ring.try_alloc(1) is None
    ring.release(first)
    assert ring.try_alloc(100) is not None


def test_a_copy_that_waits_for_ring_memory_has_handed_over_what_it_copied():
    """Copied segments reach the writers in groups. If the copy waited for ring memory with a
    group still open, the writers would wait for that group and the copy for them. The bound
    of a quarter of the ring per group keeps one writer out of that case; here a group may
    fill the ring, and 30 pieces of 400 bytes (448 in the ring) fill a 4 KiB ring with 3,600
    bytes, short of closing the group by size."""
    sources = [torch.arange(100, dtype=torch.float32) + 1000 * i for i in range(30)]
    names = [f"t{i}" for i in range(30)]
    try:
        stager = CappedStager(sources, names, sources, 4096, 64, list(range(30)))
        stager.group_bytes = stager.ring.capacity
        got: list[bytes] = []

        def consume() -> None:
            for piece in stager.sources_for_writer:
                got.append(b"".join(bytes(part) for part in piece.parts()))

        threads = [threading.Thread(target=stager.run, daemon=True),
                   threading.Thread(target=consume, daemon=True)]
        for t in threads:
            t.start()
        threads[1].join(20)
        hung = threads[1].is_alive()
        if hung:
            stager.cancel()  # lets both threads out
        assert not hung, "the copy and the writer waited on each other"
        threads[0].join(20)
        assert got == [s.numpy().tobytes() for s in sources]
        assert stager.peak_bytes <= 4096
    finally:
        staging.release_pools()
