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
from bytecheckpoint.gc_pause import gc_paused
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
                            unit(0, 300, 0, 10),  # a gap before it
                            unit(1, 310, 0, 10),  # another file
                            unit(1, 320, 0, 500),  # over the limit with its neighbour
                            unit(1, 820, 0, 10)]))
    runs = contiguous_runs(units, limit=300)
    assert [[j for j, _ in run] for run in runs] == [[0, 1, 2], [3], [4], [5], [6]]
