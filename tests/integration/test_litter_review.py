"""What a crash leaves behind is cleaned up later, and only what is provably ours and stale:

1. ``bcp gc`` without ``--cold`` killed after renaming a checkpoint aside to
   ``.<name>.deleting-<id>``: the next gc finishes it (from the record the deletion wrote
   beside it), never while its deleter lives, never a look-alike without a record, a link, or
   a directory holding someone else's files (put back instead).
2. ``.latest.tmp-*`` left by a save killed between writing and renaming the pointer: the next
   pointer update removes it once it is older than a save lease, never a fresh one.
3. A ``TokenLoader`` reader that hangs (is stopped) makes ``next()`` raise ``DataLoaderError``
   after ``reader_timeout_s``, and ``close()`` still ends it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.cli import app as cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(64, dtype=torch.float32) * step}


def _run(root: str, steps: range) -> None:
    for s in steps:
        bcp.save(f"{root}/step_{s}", {"model": _state(s)}, step=s)


def _loads_as(path: str, step: int) -> None:
    target = {"model": {k: torch.zeros_like(v) for k, v in _state(step).items()}}
    bcp.load(path, target)
    assert torch.equal(target["model"]["w"], _state(step)["w"]), path


def _worker(kind: str, root: str, marker: str) -> subprocess.Popen:
    """Start a litter worker and return it once it stalls at its moment."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.litter_workers", kind, root, marker],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdin=subprocess.DEVNULL)
    end = time.monotonic() + 120
    while not os.path.exists(marker):
        assert proc.poll() is None, f"{kind} worker exited with {proc.returncode}"
        assert time.monotonic() < end, f"{kind} worker never reached its moment"
        time.sleep(0.05)
    return proc


def _trash(root: str, name: str) -> list[str]:
    return [n for n in os.listdir(root) if n.startswith(f".{name}.deleting-") and not n.endswith(".record")]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gc(capsys, root: str) -> int:
    code = cli.main(["gc", root, "--keep-last", "1", "--yes", "-q"])
    capsys.readouterr()
    return code


def test_a_gc_killed_after_its_rename_is_finished_by_the_next_gc(capsys, tmp_path):
    root = f"{tmp_path}/run"
    _run(root, range(1, 4))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # Look-alikes: a directory with no record, and a link with a forged record naming its target.
    os.makedirs(f"{root}/.step_7.deleting-aaaaaaaaaaaa")
    Path(f"{root}/.step_7.deleting-aaaaaaaaaaaa/x").write_text("not ours")
    os.symlink(victim, f"{root}/.step_6.deleting-bbbbbbbbbbbb")
    st = os.stat(victim)
    Path(f"{root}/.step_6.deleting-bbbbbbbbbbbb.record").write_text(json.dumps({
        "id": "bbbbbbbbbbbb", "trash": f"{root}/.step_6.deleting-bbbbbbbbbbbb", "files": ["precious"],
        "host": socket.gethostname(), "pid": int(dead), "dev": st.st_dev, "ino": st.st_ino,
        "identity": ""}))

    proc = _worker("gc", root, f"{tmp_path}/stalled")
    try:
        trash = _trash(root, "step_1")
        assert len(trash) == 1, os.listdir(root)
        _gc(capsys, root)  # its deleter still works on it: left alone
        assert os.path.isdir(f"{root}/{trash[0]}")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    _gc(capsys, root)
    names = sorted(os.listdir(root))
    assert not any(n.startswith(".step_1.") for n in names), names  # finished, record too
    assert names == [".step_6.deleting-bbbbbbbbbbbb", ".step_6.deleting-bbbbbbbbbbbb.record",
                     ".step_7.deleting-aaaaaaaaaaaa", "latest", "step_3"], names
    assert (victim / "precious").read_text() == "keep"
    assert Path(f"{root}/.step_7.deleting-aaaaaaaaaaaa/x").read_text() == "not ours"
    _loads_as(root, 3)


def test_a_cut_short_deletion_holding_someone_elses_file_is_put_back(capsys, tmp_path, monkeypatch):
    from bytecheckpoint.manage import deletion

    root = f"{tmp_path}/run"
    _run(root, range(1, 3))

    class Killed(BaseException):
        pass

    def crash(*args, **kwargs):
        raise Killed  # stands for the kill: rename done, nothing deleted

    monkeypatch.setattr(deletion, "delete_tree", crash)
    with pytest.raises(Killed):
        _gc(capsys, root)
    monkeypatch.undo()
    [trash] = _trash(root, "step_1")
    Path(f"{root}/{trash}/NOTES.txt").write_text("mine")
    _gc(capsys, root)  # recovery puts it back; retention then keeps it for the note
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_2"]
    assert Path(f"{root}/step_1/NOTES.txt").read_text() == "mine"
    _loads_as(f"{root}/step_1", 1)


def test_a_pointer_temp_left_by_a_killed_save_is_removed_once_stale(tmp_path):
    root = f"{tmp_path}/run"
    proc = _worker("latest", root, f"{tmp_path}/stalled")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    [left] = [n for n in os.listdir(root) if n.startswith(".latest.tmp-")]
    fresh = f"{root}/.latest.tmp-0123456789ab"  # another host's writer, about to rename it
    Path(fresh).write_text("{}")
    old = time.time() - 400  # older than a save lease (BCP_SAVE_LEASE_S, 300 s)
    os.utime(f"{root}/{left}", (old, old))
    _run(root, range(2, 3))
    names = sorted(os.listdir(root))
    assert left not in names and ".latest.tmp-0123456789ab" in names, names
    _loads_as(root, 2)


def test_a_hung_reader_is_a_named_error_and_close_still_works(tmp_path):
    from bytecheckpoint.data import TokenLoader, synthetic_sources
    from bytecheckpoint.errors import DataLoaderError

    sources = synthetic_sources(str(tmp_path / "src"), [30], vocab=50, min_len=1, max_len=12, seed=1)
    ld = TokenLoader(sources, context=7, batch_size=2, workers=2, dp_rank=0, dp_size=1,
                     reader_timeout_s=1.0)
    next(ld)
    pid = ld._procs[0].pid
    os.kill(pid, signal.SIGSTOP)  # hangs, does not die
    try:
        t0 = time.monotonic()
        with pytest.raises(DataLoaderError, match="reader_timeout_s"):
            for _ in range(100):  # the other reader's turns first
                next(ld)
        assert time.monotonic() - t0 < 30
        with pytest.raises(DataLoaderError, match="close"):
            next(ld)  # stays stopped, at once
        with pytest.raises(bcp.errors.StagingError):
            ld.checkpoint_shards()  # a save fails by name too, without waiting
        t0 = time.monotonic()
        ld.close()
        assert time.monotonic() - t0 < 10
        assert not _alive(pid)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
