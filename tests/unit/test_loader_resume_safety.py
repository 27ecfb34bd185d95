"""TokenLoader resume safety: a resumed loader continues exactly where it stopped, or raises
a named error; never a silently wrong position, a hang, or a stray reader process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from bytecheckpoint.data import TokenLoader, TokenSource, synthetic_sources, write_source
from bytecheckpoint.errors import CorruptCheckpointError, InvalidArgumentError, StateMismatchError
from tests.support import data_workloads as d

KW = {"context": 7, "buffer_tokens": 16, "dp_rank": 0, "dp_size": 1}


def loader(sources: list[str], **kw: Any) -> TokenLoader:
    return TokenLoader(sources, **{**KW, **kw})


def batches(ld: TokenLoader, n: int | None = None) -> list[d.Consumed]:
    out = []
    for i, b in enumerate(ld):
        out.append(d.consumed(b))
        if n is not None and i + 1 == n:
            break
    return out


@contextmanager
def deadline(seconds: int):
    """Turn a hang into a test failure."""
    def fire(*_: Any) -> None:
        raise TimeoutError(f"no answer within {seconds} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> list[str]:
    return synthetic_sources(str(tmp_path_factory.mktemp("one")), [30], vocab=50, min_len=1,
                             max_len=12, seed=1)


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[str]:
    return synthetic_sources(str(tmp_path_factory.mktemp("two")), [40, 25], vocab=50, min_len=1,
                             max_len=12, seed=3)


def save_resume(sources: list[str], k: int, save_kw: dict, load_kw: dict) -> tuple[list, list, bool]:
    ld = loader(sources, **save_kw)
    before = batches(ld, k)
    with deadline(10):
        entries = ld.checkpoint_shards()
    prepared = ld.last_collect_prepared
    ld.close()
    ld = loader(sources, **load_kw)
    ld.restore_shards(entries)
    after = batches(ld)
    ld.close()
    return before + after, entries, prepared


# -- 1+2: prefetched state --------------------------------------------------------------
@pytest.mark.parametrize("workers,batch", [(w, b) for w in (1, 2, 3) for b in (2, 3, 4)])
def test_prefetched_state_is_exact_at_every_batch(one, workers, batch):
    ref = loader(one, workers=workers, batch_size=batch)
    full = batches(ref)
    ref.close()
    for k in range(1, len(full) + 1):
        kw = {"workers": workers, "batch_size": batch}
        got, _, _ = save_resume(one, k, {**kw, "checkpoint_every": k, "state_timeout_s": 5}, kw)
        assert got == full, f"resume after batch {k} of {len(full)} differs"


def test_state_collected_twice_at_one_batch(one):
    ld = loader(one, workers=2, batch_size=2, checkpoint_every=3)
    batches(ld, 3)
    with deadline(10):
        first = ld.checkpoint_shards()
        assert ld.last_collect_prepared
        second = ld.checkpoint_shards()
    ld.close()
    assert [s["cursors"] for s in first["shard/1/0"]["streams"]] == \
        [s["cursors"] for s in second["shard/1/0"]["streams"]]


# -- 3: sources ------------------------------------------------------------------------
def test_sources_in_another_order_are_refused(two):
    ld = loader(two, workers=2, batch_size=3)
    batches(ld, 3)
    entries = ld.checkpoint_shards()
    ld.close()
    with pytest.raises(StateMismatchError, match="source 0"):
        loader(two[::-1], workers=2, batch_size=3).restore_shards(entries)


def test_source_with_other_samples_is_refused(two, tmp_path):
    ld = loader(two, workers=2, batch_size=3)
    batches(ld, 3)
    entries = ld.checkpoint_shards()
    ld.close()
    t = TokenSource(two[1])
    other = write_source(str(tmp_path / "b"), [t.sample(i)[::-1] + 1 for i in range(len(t))][::-1])
    with pytest.raises(StateMismatchError, match="source 1"):
        loader([two[0], other], workers=2, batch_size=3).restore_shards(entries)


def test_appended_source_still_resumes(two, tmp_path):
    t = TokenSource(two[0])
    grown = write_source(str(tmp_path / "a"), [t.sample(i) for i in range(len(t))] + [[1, 2, 3]] * 5)
    ld = loader(two, workers=2, batch_size=3)
    before = batches(ld, 4)
    entries = ld.checkpoint_shards()
    ld.close()
    ld = loader([grown, two[1]], workers=2, batch_size=3)
    ld.restore_shards(entries)
    after = batches(ld)
    ld.close()
    ref = loader([grown, two[1]], workers=2, batch_size=3)
    assert before + after == batches(ref)
    ref.close()


# -- 4: same DP size, other workers or context -----------------------------------------
@pytest.mark.parametrize("change", [{"workers": 3}, {"context": 5}])
def test_same_dp_other_workers_or_context_resumes(two, change):
    saved: dict[str, Any] = {}
    read = []
    for r in range(2):
        ld = loader(two, workers=2, batch_size=3, dp_rank=r, dp_size=2)
        read += [p for b in batches(ld, 2 + r) for p in b]
        saved.update(ld.checkpoint_shards())
        ld.close()
    for r in range(2):
        ld = loader(two, batch_size=3, dp_rank=r, dp_size=2, **{"workers": 2, **change})
        prefixes = ld.load_prefixes(lambda p: any(k.startswith(p) for k in saved))
        ld.restore_shards({k: v for k, v in saved.items() if any(k.startswith(p) for p in prefixes)})
        read += [p for b in batches(ld) for p in b]
        ld.close()
    runs: dict[int, list[tuple[int, int]]] = {}
    for sid, start, n in read:
        runs.setdefault(sid, []).append((start, n))
    for s, path in enumerate(two):
        t = TokenSource(path)
        for i in range(len(t)):
            got = sorted(runs.pop((s << 40) | i, []))
            covered = [k for start, n in got for k in range(start, start + n)]
            assert covered == list(range(t.length(i))), (s, i, got)
    assert not runs


# -- 5: arguments ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [{"workers": 0}, {"batch_size": 0}, {"context": 0}, {"workers": -1}])
def test_invalid_sizes_are_refused(one, bad):
    with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
        loader(one, **{"workers": 2, "batch_size": 2, **bad})


# -- 6: readers die with the trainer -------------------------------------------------------
def test_readers_exit_when_the_trainer_is_killed(one, tmp_path):
    pids_file = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import os, signal
        from bytecheckpoint.data import TokenLoader
        ld = TokenLoader({one!r}, context=7, batch_size=2, workers=2, dp_rank=0, dp_size=1)
        next(ld)
        open({str(pids_file)!r}, "w").write(" ".join(str(p.pid) for p in ld._procs))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", script], cwd=root, timeout=60,
                         env={**os.environ, "PYTHONPATH": root}, stdin=subprocess.DEVNULL)
    assert out.returncode == -signal.SIGKILL
    pids = [int(p) for p in pids_file.read_text().split()]

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    end = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"reader processes {left} outlived the trainer"


# -- 7: damaged state ------------------------------------------------------------------------
def _streams(e: dict) -> list[dict]:
    return e["shard/1/0"]["streams"]


HOSTILE = {
    "frontiers": lambda e: e["replicated"]["frontiers"].__setitem__(0, -50),
    "cursors": lambda e: _streams(e)[0]["cursors"].__setitem__(0, -7),
    "cursors ": lambda e: _streams(e)[0]["cursors"].__setitem__(0, 10**6),
    "stream ids": lambda e: _streams(e)[1].__setitem__("stream", 0),
    "lengths": lambda e: _streams(e)[0]["lengths"].__setitem__(0, _streams(e)[0]["lengths"][0] + 5),
    "ids": lambda e: _streams(e)[0]["ids"].__setitem__(0, (9 << 40) | 3),
    "ids ": lambda e: _streams(e)[0]["ids"].__setitem__(0, 10**6),
    "starts/lengths": lambda e: _streams(e)[0]["starts"].__setitem__(0, 10**6),
    "rotation.next": lambda e: e["shard/1/0"]["rotation"].__setitem__("next", 7),
    "rotation.finished": lambda e: e["shard/1/0"]["rotation"].__setitem__("finished", [False]),
}


@pytest.mark.parametrize("field", list(HOSTILE))
def test_damaged_state_is_refused(two, field):
    ld = loader(two, workers=2, batch_size=3)
    batches(ld, 4)
    entries = ld.checkpoint_shards()
    ld.close()
    assert all(len(s["ids"]) for s in _streams(entries)), "the test needs buffered pieces"
    for s in _streams(entries):
        for k in ("ids", "starts", "lengths"):
            s[k] = np.array(s[k], dtype=np.int64)
    HOSTILE[field](entries)
    with pytest.raises(CorruptCheckpointError, match=field.strip()):
        loader(two, workers=2, batch_size=3).restore_shards(entries)
