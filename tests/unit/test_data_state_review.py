"""Review of TokenLoader state handling (2026-11-27): a closed loader's lost position, a
source grown after the readers ran dry, hostile saved values that raised raw errors, and the
receiver thread at close. Each test failed before its fix."""

from __future__ import annotations

import copy
import os
import threading
import time
from typing import Any

import pytest

import bytecheckpoint as bcp
import bytecheckpoint.data.loader as loader_module
from bytecheckpoint.data import TokenLoader, synthetic_sources, write_source
from bytecheckpoint.errors import (
    CorruptCheckpointError,
    DataLoaderError,
    InvalidArgumentError,
    StagingError,
    StateMismatchError,
)
from tests.support import data_workloads as d

KW = {"context": 7, "batch_size": 2, "workers": 2, "buffer_tokens": 16, "dp_rank": 0, "dp_size": 1}


def loader(sources: list[str], **kw: Any) -> TokenLoader:
    return TokenLoader(sources, **{**KW, **kw})


def batches(ld: TokenLoader, n: int | None = None) -> list[d.Consumed]:
    out = []
    for i, b in enumerate(ld):
        out.append(d.consumed(b))
        if n is not None and i + 1 == n:
            break
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[str]:
    return synthetic_sources(str(tmp_path_factory.mktemp("two")), [40, 25], vocab=50, min_len=1,
                             max_len=12, seed=3)


def test_a_closed_loader_neither_saves_nor_restarts_from_where_it_began(two, tmp_path):
    full = batches(loader(two))
    ld = loader(two)
    before = batches(ld, 5)
    entries = ld.checkpoint_shards()  # saved before close(): exact
    ld.close()
    with pytest.raises(StagingError, match="closed after 5 batches"):
        ld.checkpoint_shards()  # was: the starting position, with batches=5
    with pytest.raises(StagingError, match="save the loader before close"):
        bcp.save(str(tmp_path / "c"), {"dataloader": ld})
    assert not os.path.exists(tmp_path / "c")
    with pytest.raises(DataLoaderError, match="closed after 5 batches"):
        next(ld)  # was: the first batch again
    again = loader(two)
    again.restore_shards(entries)
    assert before + batches(again) == full
    again.close()
    unused = loader(two)
    unused.close()  # never started: its (initial) state is still its position
    assert unused.checkpoint_shards()["shard/1/0"]["batches"] == 0


def test_a_loader_that_ran_dry_reads_samples_appended_later(two, tmp_path):
    from bytecheckpoint.data import TokenSource

    ld = loader(two)
    before = batches(ld)
    entries = ld.checkpoint_shards()
    ld.close()
    dry = loader(two)
    dry.restore_shards(entries)
    assert batches(dry) == []  # the same sources: nothing more, as before
    dry.close()
    t = TokenSource(two[1])
    grown = write_source(str(tmp_path / "b"), [t.sample(i) for i in range(len(t))] + [[7, 8, 9]] * 4)
    ld = loader([two[0], grown])
    ld.restore_shards(entries)
    after = [p for b in batches(ld) for p in b]
    ld.close()
    assert sorted({sid & ((1 << 40) - 1) for sid, _, _ in after}) == [25, 26, 27, 28]  # was: []
    assert sum(n for _, _, n in after) == 12
    assert {sid >> 40 for sid, _, _ in after} == {1}
    assert not {sid for b in before for sid, _, _ in b} & {sid for sid, _, _ in after}


def _stream(e: dict, i: int = 0) -> dict:
    return e["shard/1/0"]["streams"][i]


HOSTILE = {
    "seed": lambda e: e["replicated"].__setitem__("seed", -5),
    "pad_id": lambda e: e["replicated"].__setitem__("pad_id", 1 << 40),
    "rng": lambda e: _stream(e)["rng"]["state"].__setitem__("state", 1 << 200),
    "rng ": lambda e: _stream(e)["rng"].__setitem__("uinteger", -1),
    "stream ids": lambda e: e["replicated"].__setitem__("workers", 10**12),
}


@pytest.mark.parametrize("reshard", [False, True], ids=["same", "reshard"])
def test_hostile_values_that_raised_raw_errors_are_named(two, reshard):
    """Were: ValueError, OverflowError, MemoryError, or a reader's OverflowError at next()."""
    ld = loader(two)
    batches(ld, 3)
    base = ld.checkpoint_shards()
    ld.close()
    for field, damage in HOSTILE.items():
        entries = copy.deepcopy(base)
        damage(entries)
        target = loader(two, dp_rank=1, dp_size=2) if reshard else loader(two)
        with pytest.raises(CorruptCheckpointError, match=field.strip()):
            target.restore_shards(entries)
    entries = copy.deepcopy(base)
    entries["replicated"]["dp_size"] = 10**12  # all of them "needed": was MemoryError
    with pytest.raises(StateMismatchError, match="needs all 1000000000000 saved DP shards"):
        loader(two, dp_rank=1, dp_size=2).restore_shards(entries)


@pytest.mark.parametrize("bad", [{"seed": -1}, {"seed": 1.5}, {"pad_id": 1 << 40}])
def test_invalid_seed_or_pad_id_is_refused(two, bad):
    with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
        loader(two, **bad)  # were: a raw ValueError / TypeError, or a reader failing later


def test_close_while_the_receiver_is_behind_raises_nothing_in_it(two, monkeypatch):
    """The receiver thread saw the readers' EOF after close() had emptied the loader's
    lists: an IndexError traceback from the thread (about 1 close in 75)."""
    errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    closing = threading.Event()
    real = loader_module.wait

    def late_wait(conns: Any, timeout: float | None = None) -> Any:
        ready = real(conns, timeout)
        if closing.is_set():
            time.sleep(1.0)  # close() finishes meanwhile
        return ready

    monkeypatch.setattr(loader_module, "wait", late_wait)
    ld = loader(two)
    next(ld)
    pump = ld._pump
    closing.set()
    ld.close()
    pump.join(timeout=10)
    assert not pump.is_alive()
    assert errors == []


RNG_DAMAGE = {
    "torch": lambda s: s.__setitem__("torch", s["torch"][:10]),
    "python": lambda s: s["python"].__setitem__("version", 99),
    "numpy": lambda s: s["numpy"].__setitem__("keys", s["numpy"]["keys"][:3]),
    "missing": lambda s: s.pop("numpy"),
}


@pytest.mark.parametrize("damage", list(RNG_DAMAGE))
def test_damaged_rng_state_is_named(damage):
    """Were: the generators' raw RuntimeError, ValueError, IndexError or KeyError."""
    from bytecheckpoint.state.extra import capture_rng

    state = capture_rng()
    RNG_DAMAGE[damage](state)
    with pytest.raises(CorruptCheckpointError, match="RNG state of rank 0 is damaged"):
        bcp.RNGState().restore_shards({"world_size": 1, "rank/0": state})


def test_a_save_with_prefetch_over_63_windows_is_exact(tmp_path):
    """Were: every save failed (StagingError: a reader "cut more windows ahead than it can
    rewind") and the reader died, so training could not go on either."""
    sources = synthetic_sources(str(tmp_path / "s"), [300], vocab=50, min_len=1, max_len=12, seed=2)
    kw = {"workers": 1, "prefetch": 100}
    full = batches(loader(sources, **kw))
    ld = loader(sources, **kw)
    before = batches(ld, 2)
    time.sleep(1.0)  # the reader cuts up to 100 windows ahead meanwhile
    entries = ld.checkpoint_shards()
    ld.close()
    again = loader(sources, **kw)
    again.restore_shards(entries)
    assert before + batches(again) == full
    again.close()
