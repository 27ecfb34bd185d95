"""The commit protocol under an unlucky operator and racing processes: overwrite replaces only a
committed checkpoint, two savers never destroy each other, a load never returns a mixture of
two saves, a bad ``step`` or ``latest`` is refused by name, and a crash at any point of an
overwrite leaves the old checkpoint or the new one loadable."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import bytecheckpoint as bcp
from bytecheckpoint.commit.leases import read_lease
from bytecheckpoint.errors import (
    CheckpointExistsError,
    CheckpointReplacedError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
)
from bytecheckpoint.storage import CommitMode, open_storage, register_backend
from bytecheckpoint.storage.memory import MemoryStorage
from tests.support.commit_worker import make_state, values_of
from tests.support.helpers import env_set
from tests.support.servers import s3_root

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.support.commit_worker", *args], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE, text=True)


def _last_json(proc: subprocess.Popen, timeout: float = 120) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


def _wait_for(path: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, "the worker exited early"
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _tree(root: str) -> dict[str, object]:
    """Every entry under ``root``: a file's bytes, a link's target, None for a directory."""
    out: dict[str, object] = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            full = os.path.join(d, n)
            if os.path.islink(full):
                out[os.path.relpath(full, root)] = ("link", os.readlink(full))
            elif os.path.isdir(full):
                out[os.path.relpath(full, root)] = None
            else:
                with open(full, "rb") as f:
                    out[os.path.relpath(full, root)] = f.read()
    return out


def _loaded_value(url: str, **kwargs) -> set:
    state = make_state(0)
    bcp.load(url, state, **kwargs)
    return values_of(state)


# -- 1. overwrite replaces only a committed checkpoint of this format --------------------------


def test_overwrite_refuses_a_root_a_plain_directory_a_file_and_extra_files(tmp_path):
    root = tmp_path / "run"
    for step in (1, 2):
        bcp.save(str(root / f"step_{step}"), make_state(step), step=step)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("my notes")
    (tmp_path / "file").write_text("a file")
    bcp.save(str(tmp_path / "mixed"), make_state(3))
    (tmp_path / "mixed" / "README").write_text("mine")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    before = _tree(str(tmp_path))

    cases = {"run": "root of checkpoints", "notes": "'notes.txt'", "file": "is a file",
             "mixed": "'README'", "dangling": "broken symbolic link"}
    for name, words in cases.items():
        with pytest.raises(NotACheckpointError, match=words):
            bcp.save(str(tmp_path / name), make_state(9), overwrite=True)
    assert _tree(str(tmp_path)) == before  # nothing touched, nothing left behind
    assert _loaded_value(str(root)) == {2.0}


def test_overwrite_replaces_a_committed_checkpoint_and_a_link_to_one(tmp_path):
    bcp.save(str(tmp_path / "a"), make_state(1), step=1)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        bcp.save(str(tmp_path / "a"), make_state(2), step=2)
    bcp.save(str(tmp_path / "a"), make_state(2), step=2, overwrite=True)
    assert _loaded_value(str(tmp_path / "a")) == {2.0}
    # A cooled checkpoint's hot path is a link to its cold copy: the link is replaced.
    bcp.save(str(tmp_path / "cold"), make_state(3), step=3)
    os.symlink(tmp_path / "cold", tmp_path / "hot")
    bcp.save(str(tmp_path / "hot"), make_state(4), step=4, overwrite=True)
    assert _loaded_value(str(tmp_path / "hot")) == {4.0}
    assert _loaded_value(str(tmp_path / "cold")) == {3.0}
    assert sorted(os.listdir(tmp_path)) == ["a", "cold", "hot", "latest"]  # no staging, no aside


def test_overwrite_on_mem_refuses_a_root(tmp_path):
    root = f"mem://commit-safety-{os.getpid()}/run"
    bcp.save(f"{root}/step_1", make_state(1), step=1)
    with pytest.raises(NotACheckpointError, match="root of checkpoints"):
        bcp.save(root, make_state(2), overwrite=True)
    bcp.save(f"{root}/step_1", make_state(2), step=1, overwrite=True)
    assert _loaded_value(root) == {2.0}


def test_overwrite_on_s3_refuses_a_root_and_foreign_objects():
    root = s3_root("run")
    bcp.save(f"{root}/step_1", make_state(1), step=1)
    storage, path = open_storage(root)
    storage.write_bytes(f"{path}/other/notes.txt", b"mine")
    with pytest.raises(NotACheckpointError, match="root of checkpoints"):
        bcp.save(root, make_state(2), overwrite=True)
    with pytest.raises(NotACheckpointError, match="notes.txt"):
        bcp.save(f"{root}/other", make_state(2), overwrite=True)
    assert bytes(storage.read(f"{path}/other/notes.txt")) == b"mine"
    assert _loaded_value(root) == {1.0}
    bcp.save(f"{root}/step_1", make_state(2), step=1, overwrite=True)
    assert _loaded_value(root) == {2.0}


# -- 2. two savers to one path ---------------------------------------------------------------


def test_a_second_saver_is_refused_while_the_first_lives_and_cleans_up_after_it_dies(tmp_path):
    path = str(tmp_path / "step_1")
    first = _worker("stall", path, "1")
    try:
        _wait_for(path + ".stalled", first)
        staging = [n for n in os.listdir(tmp_path) if ".staging-" in n]
        with pytest.raises(ConcurrentSaveError, match=f"pid {first.pid} on {socket.gethostname()}"):
            bcp.save(path, make_state(2), step=2)
        with pytest.raises(ConcurrentSaveError, match="in progress"):
            bcp.save(path, make_state(2), step=2, overwrite=True)
        assert [n for n in os.listdir(tmp_path) if ".staging-" in n] == staging  # untouched
        open(path + ".go", "w").close()
        assert _last_json(first) == {"ok": True}
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert _loaded_value(path) == {1.0}

    # A saver that dies mid-write: its staging is removed by the next save to that path.
    path = str(tmp_path / "step_2")
    dead = _worker("stall", path, "3")
    _wait_for(path + ".stalled", dead)
    dead.send_signal(signal.SIGKILL)
    dead.wait(30)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".step_2.staging-")]
    with pytest.raises(NotACheckpointError, match="never committed"):
        bcp.load(path, make_state(0))
    bcp.save(path, make_state(4), step=4)
    assert _loaded_value(path) == {4.0}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".step_")]


class _LeasedMemory(MemoryStorage):
    """An in-memory store with no rename: it stands for an object store (lease records)."""

    scheme = "leasemem"
    commit_mode = CommitMode.MARKER


def test_on_object_stores_a_live_lease_refuses_and_an_expired_or_dead_one_is_cleaned():
    register_backend("leasemem", _LeasedMemory, clobber=True)
    root = f"leasemem://commit-safety-{os.getpid()}"
    storage, base = open_storage(root)
    record = f"{base}/.ckpt.staging-other.owner"
    now = time.time()
    live = {"save_id": "other", "host": "elsewhere", "pid": 7, "started": now, "heartbeat": now}
    storage.write_bytes(record, json.dumps(live).encode())
    with pytest.raises(ConcurrentSaveError, match="save other, by pid 7 on elsewhere"):
        bcp.save(f"{root}/ckpt", make_state(1), step=1)
    assert storage.exists(record) and not storage.list_dir(f"{base}/ckpt")

    stale = dict(live, heartbeat=now - 3600)  # a writer on another host stopped beating
    storage.write_bytes(record, json.dumps(stale).encode())
    storage.write_bytes(f"{base}/ckpt/model-00000.safetensors", b"half of a crashed save")
    bcp.save(f"{root}/ckpt", make_state(1), step=1)
    assert _loaded_value(f"{root}/ckpt") == {1.0}
    assert not storage.exists(record)

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid on this host that has exited
    storage.write_bytes(record, json.dumps(dict(live, host=socket.gethostname(), pid=int(dead))).encode())
    bcp.save(f"{root}/ckpt", make_state(2), step=2, overwrite=True)
    assert _loaded_value(f"{root}/ckpt") == {2.0}
    assert [n for n in storage.list_dir(base) if n.startswith(".")] == []


# -- 3. a load racing an overwrite ---------------------------------------------------------


@pytest.mark.parametrize("verify", [False, True])
def test_loads_racing_overwrites_return_one_save_or_say_it_was_replaced(tmp_path, verify):
    path = str(tmp_path / "ckpt")
    bcp.save(path, make_state(1), step=1)
    with env_set({"BCP_OVERWRITE_WAIT_S": "0"}):  # the writer does not wait for our leases
        writer = _worker("loop", path, "4")
    outcomes: dict[str, int] = {"one save": 0, "replaced": 0}
    try:
        while writer.poll() is None:
            try:
                found = _loaded_value(path, verify=verify)
            except CheckpointReplacedError as exc:
                assert "load again" in str(exc)
                outcomes["replaced"] += 1
                continue
            assert found in ({1.0}, {2.0}), f"a load mixed two saves: {found}"
            outcomes["one save"] += 1
    finally:
        assert _last_json(writer)["saves"] > 2
    assert outcomes["one save"] > 0, outcomes


def test_an_overwrite_waits_for_a_load_in_progress(tmp_path):
    path = str(tmp_path / "ckpt")
    bcp.save(path, make_state(1), step=1)
    storage, p = open_storage(path)
    done = threading.Event()
    with read_lease(storage, p):  # a load of the old checkpoint is under way
        saver = threading.Thread(target=lambda: (bcp.save(path, make_state(2), step=2, overwrite=True),
                                                 done.set()))
        saver.start()
        time.sleep(1.0)
        assert not done.is_set() and _loaded_value(path) == {1.0}  # still the old one
    saver.join(30)
    assert done.is_set() and _loaded_value(path) == {2.0}


# -- 4. step and the latest pointer -----------------------------------------------------------


@pytest.mark.parametrize("step", ["init", 1.5, True, -1, 2**64, "7"])
def test_a_step_that_is_not_a_whole_number_is_refused_and_nothing_is_written(tmp_path, step):
    with pytest.raises(InvalidArgumentError, match="step="):
        bcp.save(str(tmp_path / "ckpt"), make_state(1), step=step)
    assert os.listdir(tmp_path) == []


def test_numpy_steps_are_plain_ints_and_latest_follows_the_highest(tmp_path):
    result = bcp.save(str(tmp_path / "s5"), make_state(5), step=np.int64(5))
    assert result.step == 5 and type(result.step) is int
    bcp.save(str(tmp_path / "s3"), make_state(3), step=np.int32(3))
    assert json.loads((tmp_path / "latest").read_text())["checkpoint"] == "s5"
    assert bcp.load(str(tmp_path), make_state(0)).step == 5


HOSTILE_LATEST = {
    "garbage": b"\x00\xffnot json",
    "outside": json.dumps({"checkpoint": "../elsewhere", "step": 9}).encode(),
    "absolute": json.dumps({"checkpoint": "/etc", "step": 9}).encode(),
    "string step": json.dumps({"checkpoint": "s1", "step": "init"}).encode(),
    "float step": json.dumps({"checkpoint": "s1", "step": 2.5}).encode(),
    "not an object": b"[1, 2]",
    "huge": b" " * (1 << 20) + b"{}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_LATEST))
def test_a_bad_latest_is_refused_by_name_and_replaced_by_the_next_save(tmp_path, kind):
    (tmp_path / "elsewhere").mkdir()
    run = tmp_path / "run"
    bcp.save(str(run / "s1"), make_state(1), step=1)
    bcp.save(str(tmp_path / "elsewhere" / "x"), make_state(7), step=1)
    (run / "latest").write_bytes(HOSTILE_LATEST[kind])
    with pytest.raises(CorruptCheckpointError, match="latest"):
        bcp.load(str(run), make_state(0))
    bcp.save(str(run / "s2"), make_state(2), step=2)  # commits, and repairs the pointer
    assert _loaded_value(str(run)) == {2.0}


@pytest.mark.parametrize("after_look", [1, 2])
def test_a_latest_replaced_between_two_looks_is_read_whole(tmp_path, after_look):
    """A save renames a new pointer over ``latest`` at any moment. A reader that took its size
    and then read it could get a length from one file and bytes from the other (a race with a
    tiering pass once failed with "wanted 63 bytes at 0, got 62"): the pointer is read in one
    request, so a rename right after any of the reader's storage calls changes nothing."""
    from bytecheckpoint.commit import protocol
    from bytecheckpoint.storage.local import LocalStorage

    bcp.save(str(tmp_path / "s10"), make_state(10), step=10)
    pointer = tmp_path / "latest"
    shorter = json.dumps({"checkpoint": "s9", "step": 9}).encode()

    looks = []

    class Replacing(LocalStorage):
        def size(self, path):
            n = super().size(path)
            looks.append(path)
            if path.endswith("latest") and len(looks) == after_look:
                # the save's rename lands right after this look at the pointer
                tmp = tmp_path / ".latest.new"
                tmp.write_bytes(shorter)
                os.replace(tmp, pointer)
            return n

    latest = protocol.read_latest(Replacing(fsync=False), str(tmp_path))
    assert latest in (protocol.Latest("s10", 10), protocol.Latest("s9", 9))


def test_a_directory_named_latest_is_refused(tmp_path):
    bcp.save(str(tmp_path / "s1"), make_state(1), step=1)
    os.unlink(tmp_path / "latest")
    (tmp_path / "latest").mkdir()
    with pytest.raises(CorruptCheckpointError, match="not a file"):
        bcp.load(str(tmp_path), make_state(0))


def test_an_older_release_string_step_in_latest_no_longer_breaks_integer_saves(tmp_path):
    bcp.save(str(tmp_path / "init"), make_state(1), step=0)
    (tmp_path / "latest").write_text(json.dumps({"checkpoint": "init", "step": "init"}))
    bcp.save(str(tmp_path / "s10"), make_state(2), step=10)
    assert json.loads((tmp_path / "latest").read_text())["checkpoint"] == "s10"
    assert _loaded_value(str(tmp_path)) == {2.0}


# -- 5. a crash at each step of an overwrite -------------------------------------------------


@pytest.mark.parametrize("moment, survivor", [
    ("write", 1.0), ("exchanged", 2.0), ("aside", 2.0),  # one exchange, then the old one set aside
    ("two-step:aside", 1.0), ("two-step:swapped", 2.0),  # without renameat2's exchange
])
def test_a_crash_during_an_overwrite_leaves_the_old_or_the_new_checkpoint(tmp_path, moment, survivor):
    path = str(tmp_path / "ckpt")
    bcp.save(path, make_state(1), step=1)
    proc = _worker("crash", moment, path, "2")
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert _loaded_value(str(tmp_path)) == {survivor}  # through latest, as a restart would
    assert _loaded_value(path) == {survivor}
    bcp.save(path, make_state(3), step=3, overwrite=True)  # and the path takes new saves
    assert _loaded_value(path) == {3.0}
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "latest"]


class _FailingRename(MemoryStorage):
    """Moving the new checkpoint in fails (after the old one was moved aside)."""

    scheme = "failrename"

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        if ".staging-" in src:
            raise PermissionError(f"{src}: injected")
        super().rename(src, dst, overwrite=overwrite)


def test_a_failed_commit_rename_puts_the_old_checkpoint_back():
    register_backend("failrename", _FailingRename, clobber=True)
    path = f"mem://commit-safety-{os.getpid()}/failing/ckpt"
    bcp.save(path, make_state(1), step=1)
    with pytest.raises(Exception, match="injected"):
        bcp.save(f"failrename://{path[len('mem://'):]}", make_state(2), step=2, overwrite=True)
    assert _loaded_value(path) == {1.0}


@pytest.mark.parametrize("fault", ["delete_fails", "list_fails"])
def test_s3_owner_record_left_by_a_failed_request_never_blocks_this_process(fault):
    """A save whose owner record could not be deleted (a bucket that refuses DeleteObject), or
    whose lease listing failed right after the record was written, left the record behind;
    this process's pid is alive, so every later save to the path here was refused with a
    ConcurrentSaveError naming its own finished save."""
    from bytecheckpoint.storage import faults

    root = s3_root("owner")
    bcp.save(f"{root}/ckpt", make_state(1), step=1)
    spec = {"delete_fails": "ops=delete;path=.owner;fail_call=1;permanent=1",
            "list_fails": "ops=list_dir;fail_call=1;permanent=1"}[fault]
    faults.install(spec)
    try:
        bcp.save(f"{root}/ckpt", make_state(2), step=2, overwrite=True)
        saved = 2
    except Exception:  # the listing failure fails this save, by name
        saved = 1
    finally:
        faults.install(None)
    assert _loaded_value(f"{root}/ckpt") == {float(saved)}
    for value in (3, 4):
        bcp.save(f"{root}/ckpt", make_state(value), step=value, overwrite=True)
        assert _loaded_value(f"{root}/ckpt") == {float(value)}


def test_a_cached_save_that_fails_everywhere_removes_its_staging(tmp_path):
    """Every rank failing under a cached plan (a full disk) left the shared staging directory,
    up to a whole checkpoint, behind; a fresh plan's failure already cleaned up."""
    from bytecheckpoint.planning import plan_cache
    from bytecheckpoint.storage import faults

    for cached in (False, True):
        root = tmp_path / f"cached{cached}"
        plan_cache.clear()
        bcp.save(f"{root}/ckpt", make_state(1), step=1)
        if not cached:
            plan_cache.clear()
        faults.install("errno=ENOSPC;ops=write;path=model-;fail_call=2")
        try:
            with pytest.raises(Exception, match="ENOSPC|No space"):
                bcp.save(f"{root}/ckpt", make_state(2), step=2, overwrite=True)
        finally:
            faults.install(None)
        assert sorted(os.listdir(root)) == ["ckpt", "latest"], cached
        assert _loaded_value(f"{root}/ckpt") == {1.0}


def test_a_committed_overwrite_whose_old_copy_cannot_be_deleted_is_reported_committed(tmp_path):
    """After the new checkpoint is renamed into place, deleting the one it replaced failing
    (HDFS, a permission) surfaced as a failed save while the path held the new data, and
    latest was not moved."""
    from bytecheckpoint.storage import faults

    root = tmp_path / "run"
    bcp.save(f"{root}/ckpt", make_state(1), step=1)
    faults.install("ops=delete;path=.replaced-;fail_call=1;permanent=1")
    try:
        result = bcp.save(f"{root}/ckpt", make_state(2), step=2, overwrite=True)
    finally:
        faults.install(None)
    assert result.step == 2 and _loaded_value(str(root)) == {2.0}  # through latest
    bcp.save(f"{root}/ckpt", make_state(3), step=3, overwrite=True)
    assert _loaded_value(str(root)) == {3.0}
    assert not [n for n in os.listdir(root) if ".replaced-" in n]
