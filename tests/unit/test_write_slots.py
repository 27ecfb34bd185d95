"""Host-wide write slots: at most N large local files written at once; never a hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from fractions import Fraction

import pytest

from bytecheckpoint.engine.host_files import write_shares
from bytecheckpoint.storage import write_slots
from bytecheckpoint.storage.local import SLOT_MIN_BYTES, LocalStorage

MiB = 1 << 20


@pytest.fixture
def slots_dir(tmp_path, monkeypatch):
    d = tmp_path / "slots"
    d.mkdir()
    monkeypatch.setenv(write_slots.SLOTS_DIR_ENV, str(d))
    return d


def _other_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_slot_excludes_other_threads_until_released(slots_dir, tmp_path):
    target = str(tmp_path / "f")
    held = write_slots.take(target, 1)
    assert held.fd is not None and held.waited_s < 1
    # another thread (another open file description) cannot take the only slot
    t0 = time.monotonic()
    refused = _other_thread(lambda: write_slots.take(target, 1, max_wait_s=0.2))
    assert refused.fd is None and time.monotonic() - t0 >= 0.2  # gave up waiting: went ahead
    # with two slots it takes the free one at once
    second = _other_thread(lambda: write_slots.take(target, 2, max_wait_s=0.2))
    assert second.fd is not None and second.waited_s < 0.2
    second.release()
    held.release()
    again = _other_thread(lambda: write_slots.take(target, 1, max_wait_s=0.2))
    assert again.fd is not None
    again.release()


def test_a_waiting_writer_goes_as_soon_as_the_holder_lets_go(slots_dir, tmp_path):
    target = str(tmp_path / "f")
    held = write_slots.take(target, 1)
    timer = threading.Timer(0.3, held.release)
    timer.start()
    got = _other_thread(lambda: write_slots.take(target, 1, max_wait_s=30))
    assert got.fd is not None and 0.25 <= got.waited_s < 5
    got.release()


def test_a_thread_holding_a_slot_never_waits_for_another(slots_dir, tmp_path):
    """A writer that opens a second file before the first is closed must not wait for itself."""
    target = str(tmp_path / "f")
    held = write_slots.take(target, 1)
    t0 = time.monotonic()
    nested = write_slots.take(target, 1)
    assert nested.fd is None and time.monotonic() - t0 < 0.1
    nested.release()
    held.release()
    again = write_slots.take(target, 1)
    assert again.fd is not None  # counted back: takes slots again
    again.release()


def test_a_slot_released_on_another_thread_counts_back_on_its_taker(slots_dir, tmp_path):
    """A writer may be committed on another thread than the one that wrote it."""
    target = str(tmp_path / "f")
    held = write_slots.take(target, 1)
    _other_thread(held.release)
    again = write_slots.take(target, 1, max_wait_s=0.2)
    assert again.fd is not None
    again.release()


def _hold_forever(slots: str, target: str, ready) -> None:
    os.environ[write_slots.SLOTS_DIR_ENV] = slots
    slot = write_slots.take(target, 1)
    assert slot.fd is not None
    ready.set()
    time.sleep(600)


def test_a_killed_process_releases_its_slot(slots_dir, tmp_path):
    target = str(tmp_path / "f")
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_hold_forever, args=(str(slots_dir), target, ready))
    proc.start()
    try:
        assert ready.wait(60)
        assert write_slots.take(target, 1, max_wait_s=0.2).fd is None  # the other process has it
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        got = write_slots.take(target, 1, max_wait_s=30)
        assert got.fd is not None and got.waited_s < 5
        got.release()
    finally:
        if proc.is_alive():
            proc.kill()


def test_no_usable_slot_directory_means_no_wait(tmp_path, monkeypatch):
    """A slots directory that cannot be written (or does not exist) never stops a write."""
    monkeypatch.setenv(write_slots.SLOTS_DIR_ENV, str(tmp_path / "missing" / "dir"))
    t0 = time.monotonic()
    slot = write_slots.take(str(tmp_path / "f"), 1)
    assert slot.fd is None and time.monotonic() - t0 < 0.5
    assert write_slots.take(str(tmp_path / "nowhere" / "f"), 1).fd is None  # target's dir missing
    assert write_slots.take(str(tmp_path / "f"), 0).fd is None  # slots off


def test_file_systems_have_slots_of_their_own(slots_dir, tmp_path):
    target = str(tmp_path / "f")
    held = write_slots.take(target, 1)
    names = os.listdir(slots_dir)
    assert names == [f"bcp-write-slot-{os.getuid()}-{os.stat(tmp_path).st_dev:x}-0"]
    assert os.stat(slots_dir / names[0]).st_mode & 0o077 == 0  # this user's alone
    held.release()


@pytest.mark.parametrize("planted", ["fifo", "symlink", "directory"])
def test_something_planted_at_a_slot_path_is_never_followed_or_waited_on(slots_dir, tmp_path, planted):
    target = str(tmp_path / "f")
    path = slots_dir / f"bcp-write-slot-{os.getuid()}-{os.stat(tmp_path).st_dev:x}-0"
    victim = tmp_path / "victim"
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "symlink":
        path.symlink_to(victim)
    else:
        path.mkdir()
    t0 = time.monotonic()
    slot = write_slots.take(target, 1)
    assert slot.fd is None and time.monotonic() - t0 < 0.5  # no slot, and no wait for one
    assert not victim.exists()  # the link was not followed to create its target


def _local(host_writers: int) -> LocalStorage:
    storage = LocalStorage(fsync=True)
    storage.host_writers = host_writers
    return storage


@pytest.mark.parametrize("end", ["commit", "abort"])
def test_a_large_file_holds_a_slot_until_committed_or_aborted(slots_dir, tmp_path, end):
    storage = _local(1)
    writer = storage.open_writer(str(tmp_path / "big"))
    writer.write(b"h" * 4096)  # small so far: no slot yet
    free = _other_thread(lambda: write_slots.take(str(tmp_path / "x"), 1, max_wait_s=0))
    assert free.fd is not None
    free.release()
    writer.write(bytes(SLOT_MIN_BYTES))
    taken = _other_thread(lambda: write_slots.take(str(tmp_path / "x"), 1, max_wait_s=0))
    assert taken.fd is None  # the writer holds the only slot
    getattr(writer, end)()
    taken = _other_thread(lambda: write_slots.take(str(tmp_path / "x"), 1, max_wait_s=0))
    assert taken.fd is not None
    taken.release()
    assert os.path.exists(tmp_path / "big") == (end == "commit")


def test_writers_of_one_host_take_turns_and_every_byte_lands(slots_dir, tmp_path):
    """4 threads writing 3 files each with 2 slots: never more than 2 large files in flight,
    and every file holds exactly its bytes."""
    storage = _local(2)
    lock = threading.Lock()
    state = {"now": 0, "most": 0}
    real_take = write_slots.take

    def counting_take(target, count, max_wait_s=write_slots.MAX_WAIT_S, per_process=0):
        slot = real_take(target, count, max_wait_s, per_process=per_process)
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        release = slot.release

        def counted_release():
            with lock:
                state["now"] -= 1
            release()
        slot.release = counted_release
        return slot

    write_slots.take = counting_take
    try:
        def work(i: int) -> None:
            for j in range(3):
                w = storage.open_writer(str(tmp_path / f"f{i}-{j}"))
                for k in range(3):
                    w.write(bytes([i * 16 + j * 4 + k]) * (4 * MiB))
                w.commit()
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        write_slots.take = real_take
    assert 1 <= state["most"] <= 2 and state["now"] == 0
    for i in range(4):
        for j in range(3):
            data = (tmp_path / f"f{i}-{j}").read_bytes()
            assert data == b"".join(bytes([i * 16 + j * 4 + k]) * (4 * MiB) for k in range(3))


@pytest.mark.parametrize("raw", ["many", "-1", "2.5"])
def test_a_bad_host_writers_setting_is_refused_by_name(monkeypatch, raw):
    import bytecheckpoint as bcp
    from bytecheckpoint.storage.config import settings

    monkeypatch.setenv("BCP_STORAGE_HOST_WRITERS", raw)
    with pytest.raises(bcp.errors.StorageError, match="BCP_STORAGE_HOST_WRITERS"):
        settings()
    monkeypatch.setenv("BCP_STORAGE_HOST_WRITERS", "0")
    assert settings().transfer.host_writers == 0  # off


def test_a_process_holds_at_most_its_share_of_free_slots(slots_dir, tmp_path):
    """With ``per_process=1`` a second file of the same process waits for the first, although
    a slot is free: every rank of the host gets a slot before any gets two."""
    target = str(tmp_path / "f")
    first = write_slots.take(target, 4, per_process=1)
    assert first.fd is not None
    t0 = time.monotonic()
    refused = _other_thread(lambda: write_slots.take(target, 4, max_wait_s=0.2, per_process=1))
    assert refused.fd is None and time.monotonic() - t0 >= 0.2  # waited for its share, then went ahead
    two = _other_thread(lambda: write_slots.take(target, 4, max_wait_s=0.2, per_process=2))
    assert two.fd is not None and two.waited_s < 0.2  # a share of 2 takes the free slot at once
    two.release()
    timer = threading.Timer(0.3, first.release)
    timer.start()
    got = _other_thread(lambda: write_slots.take(target, 4, max_wait_s=30, per_process=1))
    assert got.fd is not None and 0.25 <= got.waited_s < 5  # went as soon as the first let go
    got.release()


def test_a_refused_or_failed_take_gives_its_share_back(slots_dir, tmp_path, monkeypatch):
    """The share counts only slots held: a take that found no slot file, gave up waiting or
    raised leaves nothing counted, so the process's next file takes a slot at once."""
    target = str(tmp_path / "f")
    held = _other_thread(lambda: write_slots.take(target, 1))  # the only slot, held by another "rank"
    gave_up = write_slots.take(target, 1, max_wait_s=0.1, per_process=1)
    assert gave_up.fd is None
    held.release()

    def broken(*args):
        raise OSError("slot directory vanished")
    real = write_slots._take_lock
    monkeypatch.setattr(write_slots, "_take_lock", broken)
    with pytest.raises(OSError, match="vanished"):
        write_slots.take(target, 1, per_process=1)
    monkeypatch.setattr(write_slots, "_take_lock", real)
    again = _other_thread(lambda: write_slots.take(target, 1, max_wait_s=0.2, per_process=1))
    assert again.fd is not None and again.waited_s < 0.2
    again.release()


def test_a_forked_child_holds_none_of_its_parents_share(slots_dir, tmp_path):
    target = str(tmp_path / "f")
    held = write_slots.take(target, 2, per_process=1)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=lambda: out.put(write_slots.take(target, 2, max_wait_s=2, per_process=1).fd
                                               is not None))
    child.start()
    assert out.get(timeout=30) is True  # the child took the other slot without waiting on the parent's share
    child.join(timeout=30)
    held.release()


def test_a_waited_save_gives_each_writing_process_its_share(tmp_path):
    storage = LocalStorage()
    assert storage.transfer.host_writers == 4
    assert storage.for_waited_writes(Fraction(1, 4)).slots_per_process == 1  # 4 ranks, equal bytes
    assert storage.for_waited_writes(Fraction(1, 2)).slots_per_process == 2
    assert storage.for_waited_writes(Fraction(4, 7)).slots_per_process == 2  # rounded down
    assert storage.for_waited_writes(Fraction(1, 1)).slots_per_process == 4
    assert storage.for_waited_writes(Fraction(1, 8)).slots_per_process == 1  # at least one
    assert storage.for_waited_writes(None).slots_per_process == 0  # unknown: first come, first served
    assert storage.slots_per_process == 0  # an async save's storage takes no slots at all


def test_each_rank_s_share_is_its_part_of_its_host_s_bytes(monkeypatch):
    for name in ("BCP_COMM_HOST_SIZE", "LOCAL_WORLD_SIZE", "BCP_FILES_PER"):
        monkeypatch.delenv(name, raising=False)
    assert write_shares(None, None, [10, 10, 10, 10]) == [Fraction(1, 4)] * 4
    assert write_shares(None, None, [40, 10, 10, 10]) == [Fraction(4, 7)] + [Fraction(1, 7)] * 3
    # hosts of 2 ranks: each rank's part of its own host's bytes
    assert write_shares(None, 2, [30, 10, 5, 5]) == [Fraction(3, 4), Fraction(1, 4), Fraction(1, 2),
                                                     Fraction(1, 2)]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert write_shares(None, None, [30, 10, 5, 5])[0] == Fraction(3, 4)
    monkeypatch.setenv("BCP_COMM_HOST_SIZE", "3")  # the last host is short
    assert write_shares(None, None, [1, 1, 2, 6]) == [Fraction(1, 4), Fraction(1, 4), Fraction(1, 2), 1]
    monkeypatch.setenv("BCP_COMM_HOST_SIZE", "64")  # more than the world: one host
    assert write_shares(None, None, [1, 3]) == [Fraction(1, 4), Fraction(3, 4)]
    monkeypatch.setenv("BCP_COMM_HOST_SIZE", "many")  # the save reports the bad setting
    assert write_shares(None, None, [1, 3]) == [None, None]
    monkeypatch.delenv("BCP_COMM_HOST_SIZE")
    assert write_shares("host", 2, [1, 3]) == [None, None]  # the leader writes the host's files
    assert write_shares(None, 2, [0, 0, 0, 8]) == [None, None, 0, 1]  # a host with nothing to write
