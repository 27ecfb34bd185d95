"""Single-process units of the engine's fast paths: early writeback, the GC pause, the arena."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bytecheckpoint as bcp
from bytecheckpoint.engine import staging
from bytecheckpoint.engine.load_pipeline import contiguous_runs
from bytecheckpoint.engine.read_plan import ReadUnit
from bytecheckpoint.errors import StorageError
from bytecheckpoint.runtime.gc_pause import gc_paused
from bytecheckpoint.storage import writeback
from bytecheckpoint.storage.config import TransferSettings
from bytecheckpoint.storage.config import settings as storage_settings
from bytecheckpoint.storage.local import LocalStorage
from bytecheckpoint.storage.memory import MemoryStorage


def _write_in_pieces(local: LocalStorage, path: str, data: bytes, piece: int) -> object:
    writer = local.open_writer(path)
    for start in range(0, len(data), piece):
        writer.write(data[start : start + piece])
    behind = writer._behind  # type: ignore[attr-defined]
    assert writer.commit() == len(data)
    return behind


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
def test_write_behind_hands_each_full_window_to_writeback(tmp_path):
    assert writeback.available()
    data = os.urandom(100_000)
    local = LocalStorage(fsync=True, transfer=TransferSettings(part_bytes=1 << 20, threads=1,
                                                               write_behind_bytes=32_768))
    behind = _write_in_pieces(local, str(tmp_path / "f"), data, 10_000)
    # Windows are started once 32 KiB have accumulated: after 40k, 80k; the tail waits for fsync.
    assert behind.started == 80_000
    assert (tmp_path / "f").read_bytes() == data
    # Off when 0, and off without fsync (nothing would wait for the disk anyway).
    off = LocalStorage(fsync=True, transfer=TransferSettings(write_behind_bytes=0))
    assert _write_in_pieces(off, str(tmp_path / "g"), data, 10_000).started == 0
    nosync = LocalStorage(fsync=False, transfer=TransferSettings(write_behind_bytes=1))
    assert _write_in_pieces(nosync, str(tmp_path / "h"), data, 10_000).started == 0
    assert (tmp_path / "g").read_bytes() == data == (tmp_path / "h").read_bytes()


def _resident_pages(path: str) -> list[bool]:
    """Which pages of ``path`` are in the page cache (``mincore`` on a mapping that is never
    touched, so looking does not fault anything in)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(ctypes.addressof(anchor), size, vec) == 0, os.strerror(ctypes.get_errno())
        del anchor
        return [bool(b & 1) for b in vec.raw]
    finally:
        mm.close()


def _on_tmpfs(path: str) -> bool:
    best, fstype = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, kind = line.split()[:3]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, fstype = mount, kind
    return fstype == "tmpfs"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
def test_drop_behind_keeps_only_the_newest_windows_cached(tmp_path):
    if _on_tmpfs(str(tmp_path)):
        pytest.skip("tmpfs: the page cache is the data and cannot be dropped")
    window = 256 << 10
    data = os.urandom(4 << 20)
    path = str(tmp_path / "f")
    local = LocalStorage(fsync=True, transfer=TransferSettings(part_bytes=64 << 20, threads=1,
                                                               write_behind_bytes=window))
    writer = local.open_writer(path)
    for start in range(0, len(data), 64 << 10):
        writer.write(data[start : start + (64 << 10)])
    behind = writer._behind  # type: ignore[attr-defined]
    # Every full window was started; all but the newest one were waited for and dropped.
    assert behind.started == len(data)
    assert behind.dropped == len(data) - window
    resident = _resident_pages(path)
    page = len(data) // len(resident)
    assert not any(resident[: behind.dropped // page])
    assert writer.commit() == len(data)
    assert not any(_resident_pages(path))  # the fsync made it all durable; the rest is dropped
    with open(path, "rb") as f:
        assert f.read() == data

    # Off: the page cache keeps what was written.
    keep = LocalStorage(fsync=True, transfer=TransferSettings(write_behind_bytes=window, drop_behind=False))
    kept = _write_in_pieces(keep, str(tmp_path / "g"), data, 64 << 10)
    assert kept.dropped == 0  # type: ignore[attr-defined]
    assert all(_resident_pages(str(tmp_path / "g")))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise is Linux-only")
def test_large_reads_drop_what_they_consumed(tmp_path):
    if _on_tmpfs(str(tmp_path)):
        pytest.skip("tmpfs: the page cache is the data and cannot be dropped")
    data = os.urandom(96 << 20)
    path = tmp_path / "f"
    path.write_bytes(data)
    os.sync()
    def cached() -> float:
        pages = _resident_pages(str(path))
        return sum(pages) / len(pages)

    for drop, threads in ((True, 1), (True, 3), (False, 1)):
        transfer = TransferSettings(part_bytes=32 << 20, threads=threads, drop_behind=drop)
        local = LocalStorage(transfer=transfer)
        out = bytearray(len(data))
        assert local.read_into(str(path), 0, memoryview(out)) == len(data)
        assert out == data
        # Concurrent parts: one part's readahead (at most 16 MiB past its end under
        # POSIX_FADV_SEQUENTIAL) may still be in flight when the others' pages are dropped.
        most = 0.4 if threads > 1 else 0.05
        assert (cached() < most) if drop else (cached() > 0.9), (drop, threads, cached())
        many = [bytearray(40 << 20), bytearray(56 << 20)]
        assert local.read_into_many(str(path), 0, [memoryview(b) for b in many]) == len(data)
        assert b"".join(many) == data
        assert (cached() < 0.05) if drop else (cached() > 0.9), (drop, threads, cached())
    # Small reads (headers, metadata) keep their pages: they may be read again.
    small = bytearray(4096)
    LocalStorage().read_into(str(path), 0, memoryview(small))
    assert _resident_pages(str(path))[0]


def test_drop_behind_wait_errors(tmp_path, monkeypatch):
    """A failed wait for writeback raises (it consumed the error a later fsync would have
    reported); a file system that cannot do it only loses the dropping."""
    import errno as errno_

    fd = os.open(str(tmp_path / "f"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for code, raises in ((errno_.EIO, True), (errno_.ENOSPC, True), (errno_.EINVAL, False)):
            def fake(fd_, offset, length, flags, code=code):
                if flags & writeback.SYNC_FILE_RANGE_WAIT_AFTER:
                    import ctypes
                    ctypes.set_errno(code)
                    return -1
                return 0

            monkeypatch.setattr(writeback, "_sync_file_range", lambda fake=fake: fake)
            behind = writeback.WriteBehind(fd, 100, drop=True)
            behind.advance(100)
            if raises:
                with pytest.raises(OSError, match=r"writing back bytes 0\.\.100") as info:
                    behind.advance(200)
                assert info.value.errno == code
                # The file stays failed: a retried write or the commit raises it again.
                with pytest.raises(OSError, match=r"writing back bytes 0\.\.100"):
                    behind.advance(300)
                with pytest.raises(OSError, match=r"writing back bytes 0\.\.100"):
                    behind.check()
            else:
                behind.advance(200)
                behind.advance(400)  # dropping is off from now on; writeback goes on
                assert (behind.started, behind.dropped) == (400, 0)
    finally:
        os.close(fd)


def test_write_behind_setting(monkeypatch):
    monkeypatch.setenv("BCP_STORAGE_WRITE_BEHIND_BYTES", "0")
    assert storage_settings().transfer.write_behind_bytes == 0
    monkeypatch.setenv("BCP_STORAGE_WRITE_BEHIND_BYTES", "1048576")
    assert storage_settings().transfer.write_behind_bytes == 1 << 20
    monkeypatch.setenv("BCP_STORAGE_WRITE_BEHIND_BYTES", "lots")
    with pytest.raises(StorageError, match="BCP_STORAGE_WRITE_BEHIND_BYTES.*not a valid int"):
        storage_settings()
    monkeypatch.delenv("BCP_STORAGE_WRITE_BEHIND_BYTES")
    assert storage_settings().transfer.write_behind_bytes == TransferSettings().write_behind_bytes
    assert storage_settings().transfer.drop_behind is True
    monkeypatch.setenv("BCP_STORAGE_DROP_BEHIND", "0")
    assert storage_settings().transfer.drop_behind is False
    monkeypatch.setenv("BCP_STORAGE_DROP_BEHIND", "sometimes")
    with pytest.raises(StorageError, match="BCP_STORAGE_DROP_BEHIND.*not a valid flag"):
        storage_settings()


def test_gc_pause_nests_and_leaves_a_disabled_collector_alone(monkeypatch):
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    gc.disable()  # a training script that runs the collector by hand
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    monkeypatch.setenv("BCP_GC_PAUSE", "0")
    with gc_paused():
        assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failed save")
    assert gc.isenabled()


def test_a_gc_hold_outlives_the_pause_and_is_released_once_from_another_thread():
    import threading

    from bytecheckpoint.runtime.gc_pause import hold

    assert gc.isenabled()
    with gc_paused():
        release = hold()  # an overlapped save: held past save() until its copy is done
    assert not gc.isenabled()
    worker = threading.Thread(target=release)
    worker.start()
    worker.join()
    assert gc.isenabled()
    with gc_paused():
        release()  # a second release must not end another pause
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_save_worker_runs_jobs_in_order_in_fresh_contexts_and_survives_a_failing_one():
    import contextvars
    import threading

    from bytecheckpoint.engine.async_save import _Worker

    var: contextvars.ContextVar[str] = contextvars.ContextVar("probe", default="fresh")
    seen: list[str] = []
    done = threading.Event()

    def job(tag: str) -> None:
        seen.append(f"{tag}:{var.get()}")
        var.set(tag)  # must not leak into the next job

    def failing() -> None:
        raise RuntimeError("a job whose handle reports the failure")

    worker = _Worker()
    worker.submit(lambda: job("a"))
    worker.submit(failing)
    worker.submit(lambda: job("b"))
    worker.submit(done.set)
    assert done.wait(10)
    assert seen == ["a:fresh", "b:fresh"]
    thread = worker._thread
    worker.submit(done.clear)
    assert worker._thread is thread  # one thread, kept


def test_a_save_whose_thread_cannot_start_finishes_in_the_caller(tmp_path, monkeypatch):
    import bytecheckpoint as bcp
    from bytecheckpoint.engine import async_save

    def no_thread(job):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(async_save._WORKER, "submit", no_thread)
    model = torch.nn.Linear(8, 8)
    handle = bcp.save(str(tmp_path / "a"), {"model": model}, async_save=True, snapshot="overlapped")
    assert handle.done() and handle.wait().total_bytes > 0
    assert gc.isenabled()
    fresh = torch.nn.Linear(8, 8)
    bcp.load(str(tmp_path / "a"), {"model": fresh})
    assert torch.equal(fresh.weight, model.weight)


class _Probe:
    """A stateful object that records whether the collector ran while it was saved."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def state_dict(self) -> dict:
        self.seen.append(gc.isenabled())
        return {"n": 1}

    def load_state_dict(self, sd: dict) -> None:
        self.seen.append(gc.isenabled())


def test_save_and_load_run_with_the_collector_paused_then_restore_it(tmp_path):
    probe = _Probe()
    state = {"model": torch.nn.Linear(4, 4), "probe": probe}
    bcp.save(str(tmp_path / "a"), state, framework="single")
    bcp.save(str(tmp_path / "b"), state, framework="single", async_save=True).wait()
    bcp.load(str(tmp_path / "a"), state, framework="single")
    assert len(probe.seen) >= 3 and not any(probe.seen) and gc.isenabled()


def test_host_arena_is_zeroed_reused_and_grows():
    pool = staging.HostBufferPool(pinned=False)
    a = pool.reserve(3 << 20)
    assert a.numel() == 3 << 20 and int(a.sum()) == 0 and pool.allocations == 1
    a[:10] = 7
    b = pool.reserve(1 << 20)
    assert pool.allocations == 1 and b.data_ptr() == a.data_ptr() and int(b[:10].sum()) == 70
    c = pool.reserve(5 << 20)
    assert pool.allocations == 2 and c.numel() == 5 << 20 and int(c.sum()) == 0
    src = torch.arange(1000, dtype=torch.float32)
    c[:4000].view(torch.float32).copy_(src)
    assert torch.equal(c[:4000].view(torch.float32), src)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9000), min_size=1, max_size=12), st.integers(0, 500),
       st.integers(0, 30_000))
def test_vectored_read_fills_each_buffer_in_order_and_stops_at_eof(tmp_path_factory, sizes, offset,
                                                                     file_size):
    root = tmp_path_factory.mktemp("vec")
    data = os.urandom(file_size)
    (root / "f").write_bytes(data)
    for backend in (LocalStorage(fsync=False), MemoryStorage()):
        path = str(root / "f")
        if isinstance(backend, MemoryStorage):
            backend.write_bytes(path, data)
        bufs = [bytearray(n) for n in sizes]
        got = backend.read_into_many(path, offset, [memoryview(b) for b in bufs])
        want = data[offset : offset + sum(sizes)]
        assert got == len(want)
        assert b"".join(bufs)[:got] == want


def test_small_reads_go_out_in_few_calls(tmp_path, monkeypatch):
    from bytecheckpoint.storage import local as local_mod

    data = os.urandom(3 << 20)
    (tmp_path / "f").write_bytes(data)
    calls = []
    real = os.preadv
    monkeypatch.setattr(local_mod.os, "preadv",
                        lambda fd, bufs, off: calls.append(len(bufs)) or real(fd, bufs, off))
    bufs = [bytearray(3072) for _ in range(1024)]
    views = [memoryview(b) for b in bufs]
    assert LocalStorage(fsync=False).read_into_many(str(tmp_path / "f"), 0, views) == 3 << 20
    assert b"".join(bufs) == data and len(calls) == 1  # 1,024 buffers, 3 MiB: one system call


def test_contiguous_runs_join_back_to_back_units_of_one_file_up_to_a_limit():
    def unit(file: int, box_offset: int, start: int, stop: int) -> ReadUnit:
        return ReadUnit(file, box_offset, stop, start, stop, 0, ())

    units = list(enumerate([unit(0, 0, 0, 100), unit(0, 100, 0, 100), unit(0, 200, 0, 50),
                            unit(0, 250 + 4095, 0, 10),  # behind padding (at most 4095 bytes)
                            unit(0, 4355 + 4096, 0, 10),  # a gap of 4096: no padding, another read
                            unit(1, 310, 0, 10),  # another file
                            unit(1, 320, 0, 500),  # over the limit with its neighbour
                            unit(1, 820, 0, 10)]))
    runs = contiguous_runs(units, limit=300)
    assert [[j for j, _ in run] for run in runs] == [[0, 1, 2, 3], [4], [5], [6], [7]]


def test_read_spans_skips_the_padding_between_views(tmp_path):
    from bytecheckpoint.engine.load_pipeline import read_spans

    data = bytes(range(256)) * 4
    (tmp_path / "f").write_bytes(data)
    storage, path = LocalStorage(fsync=False), str(tmp_path / "f")
    spans = [(10, memoryview(bytearray(20))), (30, memoryview(bytearray(5))),  # back to back
             (35 + 63, memoryview(bytearray(100)))]  # behind 63 bytes of padding
    assert read_spans(storage, path, spans) == [20, 5, 100]
    assert [bytes(v) for _, v in spans] == [data[10:30], data[30:35], data[98:198]]
    first, last = memoryview(bytearray(20)), memoryview(bytearray(50))
    assert read_spans(storage, path, [(990, first), (1010, last)]) == [20, 14]  # the file ends
    assert bytes(first) == data[990:1010] and bytes(last[:14]) == data[1010:]


def test_load_reader_threads_are_shared_by_the_ranks_of_a_host(monkeypatch):
    from bytecheckpoint.engine.load import read_threads_setting, share_of_host

    assert [share_of_host(n, cores=64) for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    # No more threads than the rank's share of the cores, and never none.
    assert [share_of_host(n, cores=2) for n in (1, 2, 3, 4)] == [2, 1, 1, 1]
    assert share_of_host(1, cores=1) == 1 and share_of_host(0, cores=0) == 1
    assert share_of_host(2) == share_of_host(2, cores=len(os.sched_getaffinity(0)))
    monkeypatch.delenv("BCP_LOAD_THREADS", raising=False)
    assert read_threads_setting() is None
    monkeypatch.setenv("BCP_LOAD_THREADS", "3")
    assert read_threads_setting() == 3
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv("BCP_LOAD_THREADS", bad)
        with pytest.raises(ValueError, match="BCP_LOAD_THREADS.*not a positive integer"):
            read_threads_setting()


def _one_box_pipeline(tmp_path, data: bytes, checked, storage=None):
    from bytecheckpoint.engine.load_pipeline import BoxRead, Copy, LoadPipeline, direct_target
    from bytecheckpoint.format.boxes import Box
    from bytecheckpoint.planners import LocalShard

    (tmp_path / "f").write_bytes(data)
    shard = LocalShard(Box((0,), (len(data),)), torch.zeros(len(data), dtype=torch.uint8))
    read = BoxRead("model/w", "f", 0, len(data), 0, len(data), (), torch.uint8,
                   Box((0,), (len(data),)), [Copy(Box((0,), (len(data),)), shard)])
    read.direct = direct_target(read)
    unit = ReadUnit(0, 0, len(data), 0, len(data), 0, ())
    pipe = LoadPipeline(storage or LocalStorage(fsync=False), str(tmp_path), [unit], {unit.box: read},
                        rank=0, group=None, global_rank=lambda r: r, threads=1, verify=False,
                        chunk_bytes=1 << 20, device=torch.device("cpu"), checked=checked)
    return pipe, shard


def test_load_reads_start_before_the_file_check_ends_and_its_failure_still_wins(tmp_path):
    """The check of the files' sizes and headers runs beside the reads (in a resharded load it
    took 0.2-0.6 s); its error is the load's, by name, though the reads themselves succeeded."""
    import threading
    from concurrent.futures import Future

    from bytecheckpoint.errors import CorruptCheckpointError

    read_started = threading.Event()

    class Watched(LocalStorage):
        def read_into(self, path, offset, buffer):
            read_started.set()
            return super().read_into(path, offset, buffer)

    checked: Future = Future()

    def check() -> None:  # finishes only once a read has begun (or after 10 s: the reads waited)
        began = read_started.wait(10)
        checked.set_exception(CorruptCheckpointError(f"f: the check failed (reads began first: {began})"))

    threading.Thread(target=check, daemon=True).start()
    data = os.urandom(4096)
    pipe, shard = _one_box_pipeline(tmp_path, data, checked, Watched(fsync=False))
    outcome = pipe.run()
    assert isinstance(outcome.error, CorruptCheckpointError)
    assert "reads began first: True" in str(outcome.error)
    assert bytes(shard.data.numpy()) == data  # read, though the load as a whole fails

    passed: Future = Future()
    passed.set_result(None)
    pipe, shard = _one_box_pipeline(tmp_path, data, passed)
    assert pipe.run().error is None and bytes(shard.data.numpy()) == data


def test_a_failed_file_check_replaces_the_raw_read_error_of_the_same_file(tmp_path):
    from concurrent.futures import Future

    from bytecheckpoint.errors import CorruptCheckpointError

    checked: Future = Future()
    checked.set_exception(CorruptCheckpointError("f: storage file is missing from the checkpoint"))
    pipe, _ = _one_box_pipeline(tmp_path, b"x" * 64, checked)
    os.remove(tmp_path / "f")  # every read of it fails with FileNotFoundError
    outcome = pipe.run()
    assert isinstance(outcome.error, CorruptCheckpointError) and "missing" in str(outcome.error)


def test_a_confirmed_snapshot_stays_with_the_step_hook_until_its_copy_is_done():
    """On CUDA training may confirm once the copies are queued; every optimizer step until
    they are done must still make its stream wait, so the step hook keeps the snapshot."""
    from bytecheckpoint.engine import snapshot

    snap = snapshot.begin({}, changed=lambda: None)
    try:
        snap.queued.set()
        snap.events = {torch.device("cpu"): object()}  # as if copies were queued on a device
        assert snap.released()
        snap.pass_by()  # a forward: confirms without waiting
        assert snap.confirmed.is_set() and snap.changed_name is None
        assert snapshot._ACTIVE is snap  # not done: later steps still wait on the copy
        snap.finished()
        assert snapshot._ACTIVE is None
    finally:
        snap.finished()


def test_a_save_that_fails_before_its_copy_starts_releases_training(tmp_path, monkeypatch):
    """If the overlapped save's work fails before any copy (here: the staging thread cannot
    start), the snapshot is still marked done: the step hook, wait() and the next save return
    with the error instead of waiting for a copy that never comes."""
    import bytecheckpoint as bcp
    from bytecheckpoint.engine import save as save_mod

    monkeypatch.setenv("BCP_STAGING_MAX_BYTES", str(1 << 20))  # the copy runs in rounds
    monkeypatch.setenv("BCP_SNAPSHOT_WRITE_THROUGH", "0")  # through the arena, not from the tensors
    model = torch.nn.Linear(1024, 1024)  # 4 MiB: more than the bound

    def no_thread(*_args, **_kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(save_mod._Sources, "stage_in_background", no_thread)
    handle = bcp.save(str(tmp_path / "x"), {"model": model}, async_save=True, snapshot="overlapped",
                      chunk_bytes=1 << 18)
    assert handle.wait_snapshot(timeout=30)
    with pytest.raises(RuntimeError, match="new thread"):
        handle.wait(timeout=30)
    assert not (tmp_path / "x").exists()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=10), st.integers(1, 40))
def test_descriptor_segments_cover_the_views_in_order_within_the_limit(sizes, limit):
    from bytecheckpoint.storage.local import _segments

    data = os.urandom(sum(sizes))
    views, at = [], 0
    for n in sizes:
        views.append(memoryview(data)[at : at + n])
        at += n
    groups = list(_segments(views, limit))
    assert b"".join(bytes(v) for g in groups for v in g) == data
    assert all(len(v) for g in groups for v in g)  # no empty view is read
    lengths = [sum(len(v) for v in g) for g in groups]
    assert all(n == limit for n in lengths[:-1]) and all(0 < n <= limit for n in lengths)


def test_long_reads_open_a_fresh_descriptor_per_segment_and_stop_at_eof(tmp_path, monkeypatch):
    """A long sequential read goes through a new descriptor every ``_DESCRIPTOR_BYTES``
    (readahead restarts; measured faster in loads), with every byte in place, and a file
    that ends mid-read gives back exactly the bytes it has."""
    from bytecheckpoint.storage import local as local_mod

    limit = (1 << 20) + 3  # odd: segments cut views and 4 MiB calls off their boundaries
    monkeypatch.setattr(local_mod, "_DESCRIPTOR_BYTES", limit)
    data = os.urandom((5 << 20) + 777)
    path = str(tmp_path / "f")
    (tmp_path / "f").write_bytes(data)
    per_descriptor: list[int] = []
    real_open, real_preadv = local_mod._open_regular, os.preadv

    def opened(p: str) -> int:
        per_descriptor.append(0)
        return real_open(p)

    def preadv(fd: int, bufs: list, off: int) -> int:
        n = real_preadv(fd, bufs, off)
        per_descriptor[-1] += n
        return n

    real_reopen = local_mod._reopen

    def reopened(fd: int) -> int:
        new = real_reopen(fd)
        assert new != fd and os.fstat(new).st_ino == os.fstat(fd).st_ino  # the same file, anew
        per_descriptor.append(0)
        return new

    monkeypatch.setattr(local_mod, "_open_regular", opened)
    monkeypatch.setattr(local_mod, "_reopen", reopened)
    monkeypatch.setattr(local_mod.os, "preadv", preadv)
    transfer = TransferSettings(part_bytes=64 << 20, threads=1)
    local = LocalStorage(fsync=False, transfer=transfer)
    bufs = [bytearray(n) for n in (5, (2 << 20) + 1, 0, 3 << 20, 770)]
    assert local.read_into_many(path, 1, [memoryview(b) for b in bufs]) == sum(map(len, bufs))
    assert b"".join(bufs) == data[1 : 1 + sum(map(len, bufs))]
    assert per_descriptor and max(per_descriptor) <= limit
    assert sum(per_descriptor) == sum(map(len, bufs))
    per_descriptor.clear()
    out = bytearray(len(data))
    assert local.read_into(path, 0, memoryview(out)) == len(data) and out == data
    assert max(per_descriptor) <= limit
    # The file ends inside the third segment: the bytes before its end, and no more.
    past = bytearray(len(data) + 3 * limit)
    want = len(data) - (2 * limit + 10)
    assert local.read_into_many(path, 2 * limit + 10, [memoryview(past)]) == want
    assert past[:want] == data[2 * limit + 10 :]
    # Ending exactly on a segment boundary.
    exact = bytearray(len(data))
    assert local.read_into_many(path, len(data) - 2 * limit, [memoryview(exact)]) == 2 * limit
    assert exact[: 2 * limit] == data[-2 * limit :]


def test_a_file_renamed_over_the_path_mid_read_is_not_read(tmp_path, monkeypatch):
    """Every segment of one read comes from the file its first descriptor opened: a file
    renamed over the path between segments (an overwriting save) never mixes into it."""
    from bytecheckpoint.storage import local as local_mod

    limit = 1 << 20
    monkeypatch.setattr(local_mod, "_DESCRIPTOR_BYTES", limit)
    old, new = os.urandom(3 * limit), os.urandom(3 * limit)
    path = tmp_path / "f"
    path.write_bytes(old)
    (tmp_path / "g").write_bytes(new)
    real_reopen = local_mod._reopen

    def replace_then_reopen(fd: int) -> int:
        if (tmp_path / "g").exists():
            os.replace(tmp_path / "g", path)
        return real_reopen(fd)

    monkeypatch.setattr(local_mod, "_reopen", replace_then_reopen)
    out = bytearray(3 * limit)
    local = LocalStorage(fsync=False, transfer=TransferSettings(threads=1))
    assert local.read_into_many(str(path), 0, [memoryview(out)]) == len(old)
    assert out == old and path.read_bytes() == new


def test_without_proc_a_long_read_keeps_its_first_descriptor(tmp_path, monkeypatch):
    """Where ``/proc/self/fd`` cannot be opened (no procfs), the segments read on through the
    first descriptor: the same bytes, only without fresh readahead state."""
    from bytecheckpoint.storage import local as local_mod

    monkeypatch.setattr(local_mod, "_DESCRIPTOR_BYTES", 1 << 20)
    data = os.urandom((3 << 20) + 5)
    (tmp_path / "f").write_bytes(data)
    real_open = os.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(local_mod.os, "open", no_proc)
    out = bytearray(len(data))
    local = LocalStorage(fsync=False, transfer=TransferSettings(threads=1))
    assert local.read_into_many(str(tmp_path / "f"), 0, [memoryview(out)]) == len(data)
    assert out == data
