"""The reshardable token loader: exact resume, DP changes without loss or repeats, prefetch,
RNG state, and per-rank state that cannot reshard.

"Consumed" is tracked per token: every window lists the (sample, first token, count) runs it
holds, so a test can check that every token of every sample was emitted exactly once.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bytecheckpoint as bcp
from bytecheckpoint.data import TokenSource, synthetic_sources
from bytecheckpoint.data.streams import Layout, Stream, initial_states, reshard
from bytecheckpoint.state.extra import capture_rng, restore_rng
from tests.support import data_workloads as d
from tests.support.dist import WorldPool


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[str]:
    root = str(tmp_path_factory.mktemp("sources"))
    return synthetic_sources(root, [240, 160], vocab=251, min_len=3, max_len=120, seed=5)


def assert_every_token_once(sources: list[str], pieces: d.Consumed) -> None:
    """Every token of every sample appears in exactly one emitted run (empty samples have
    no tokens to emit)."""
    runs: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for sid, start, n in pieces:
        runs[sid].append((start, n))
    expected = {}
    for s, path in enumerate(sources):
        src = TokenSource(path)
        for i in range(len(src)):
            if src.length(i):
                expected[(s << 40) | i] = src.length(i)
    assert set(runs) == set(expected), (len(set(expected) - set(runs)), len(set(runs) - set(expected)))
    for sid, parts in runs.items():
        parts.sort()
        pos = 0
        for start, n in parts:
            assert start == pos, f"sample {sid}: gap or overlap at token {pos} (next run at {start})"
            pos += n
        assert pos == expected[sid], f"sample {sid}: {pos} of {expected[sid]} tokens"


def test_one_loader_emits_every_token_exactly_once(sources):
    pieces, tokens = d.run_loader(d.make_loader(sources, 0, 1))
    assert_every_token_once(sources, pieces)
    assert all(t.shape[1] == d.LOADER["context"] + 1 for t in tokens)


@pytest.mark.parametrize("prefetch", [False, True], ids=["collect", "prefetch"])
def test_resume_in_one_process_is_exact(sources, prefetch):
    every = 4 if prefetch else None
    full, _ = d.run_loader(d.make_loader(sources, 0, 1))
    first = d.make_loader(sources, 0, 1, checkpoint_every=every)
    before, _ = d.run_loader(first, 8)
    entries = first.checkpoint_shards()
    first.close()
    second = d.make_loader(sources, 0, 1)
    second.restore_shards(entries)
    after, _ = d.run_loader(second)
    assert before + after == full


@pytest.mark.parametrize("old, new", [(4, 2), (2, 3), (4, 1), (1, 3)])
def test_reshard_in_process_loses_and_repeats_nothing(sources, old, new):
    loaders = [d.make_loader(sources, r, old) for r in range(old)]
    pieces: d.Consumed = []
    entries = {}
    for r, loader in enumerate(loaders):
        got, _ = d.run_loader(loader, 3 + r)  # ranks at different positions
        pieces += got
        entries.update(loader.checkpoint_shards())
        loader.close()
    for r in range(new):
        loader = d.make_loader(sources, r, new)
        loader.restore_shards(entries)
        got, _ = d.run_loader(loader)
        pieces += got
    assert_every_token_once(sources, pieces)


@st.composite
def stream_case(draw):
    sizes = draw(st.lists(st.integers(0, 30), min_size=1, max_size=3))
    old = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))  # dp, workers
    new = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    window = draw(st.integers(2, 9))
    steps = draw(st.lists(st.integers(0, 12), min_size=old[0] * old[1], max_size=old[0] * old[1]))
    return sizes, old, new, window, steps


@settings(max_examples=60, deadline=None)
@given(stream_case(), st.integers(0, 2**31))
def test_reshard_keeps_every_token_exactly_once(tmp_path_factory, case, seed):
    sizes, (dp, workers), (new_dp, new_workers), window, steps = case
    root = tmp_path_factory.mktemp("prop")
    paths = synthetic_sources(str(root), sizes, vocab=50, min_len=0, max_len=7, seed=seed)
    srcs = [TokenSource(p) for p in paths]
    layout = Layout(paths, [1.0 + i for i in range(len(paths))], seed, window, workers, dp, 5)
    pieces: d.Consumed = []
    states = []
    for state, n in zip(initial_states(layout), steps):
        stream = Stream(layout, state, srcs)
        cut = []
        for _ in range(n):
            w = stream.next_window()
            if w is None:
                break
            cut.append(w)
        emitted, pending = cut[: len(cut) // 2], cut[len(cut) // 2 :]  # some cut, not handed out
        for w in emitted:
            pieces += [(int(i), int(s), int(k)) for i, s, k in zip(w.pieces.ids, w.pieces.starts,
                                                                  w.pieces.lengths)]
        states.append(stream.snapshot(pending))
    new_layout, new_states = reshard(layout, states, sizes, new_dp, new_workers)
    for state in new_states:
        stream = Stream(new_layout, state, srcs)
        while (w := stream.next_window()) is not None:
            pieces += [(int(i), int(s), int(k)) for i, s, k in zip(w.pieces.ids, w.pieces.starts,
                                                                  w.pieces.lengths)]
    assert_every_token_once(paths, [p for p in pieces if p[2] > 0])


def test_state_is_prepared_ahead_of_checkpoint_steps_and_still_exact(sources):
    """With checkpoint_every=5 the state at batch 5 arrives with the batch; at batch 7 it is
    collected on demand. Both resume exactly (bench/loader_prefetch.py measures the cost)."""
    full, _ = d.run_loader(d.make_loader(sources, 0, 1))
    loader = d.make_loader(sources, 0, 1, checkpoint_every=5)
    before5, _ = d.run_loader(loader, 5)
    at5 = loader.checkpoint_shards()
    assert loader.last_collect_prepared
    before7, _ = d.run_loader(loader, 2)
    at7 = loader.checkpoint_shards()
    assert not loader.last_collect_prepared
    loader.close()
    for entries, before in ((at5, before5), (at7, before5 + before7)):
        again = d.make_loader(sources, 0, 1)
        again.restore_shards(entries)
        assert before + d.run_loader(again)[0] == full


@pytest.fixture(scope="module")
def tp_dp_run(world, sources, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("loader") / "tp2dp2")
    return path, world(4).run(d.loader_save, path, sources, 2, 5)


def test_tp_change_gives_each_dp_rank_its_exact_sequence(world, sources, tp_dp_run):
    path, saved = tp_dp_run
    # TP peers read the same data, so their DP shard is written once (identical copies)
    assert all(np.array_equal(a, b) for a, b in zip(saved[0]["tokens"], saved[1]["tokens"]))
    resumed = world(2).run(d.loader_resume, path, sources, 1)  # TP 2 -> 1, DP stays 2
    for dp_rank in (0, 1):
        reference, ref_tokens = d.run_loader(d.make_loader(sources, dp_rank, 2))
        before = next(s for s in saved if s["dp_rank"] == dp_rank)
        after = resumed[dp_rank]
        assert before["pieces"] + after["pieces"] == reference
        assert all(np.array_equal(a, b) for a, b in zip(before["tokens"] + after["tokens"], ref_tokens))


@pytest.mark.parametrize("old, new", [(4, 2), (2, 3)])
def test_dp_change_through_a_checkpoint_loses_and_repeats_nothing(world, sources, tmp_path, old, new):
    path = str(tmp_path / f"dp{old}")
    saved = world(old).run(d.loader_save, path, sources, 1, 4)
    resumed = world(new).run(d.loader_resume, path, sources, 1)
    pieces = [p for r in saved + resumed for p in r["pieces"]]
    assert_every_token_once(sources, pieces)
    uninterrupted = [p for r in range(old) for p in d.run_loader(d.make_loader(sources, r, old))[0]]
    assert collections.Counter(s for s, _, n in pieces for _ in range(n)) == collections.Counter(
        s for s, _, n in uninterrupted for _ in range(n))


def test_training_resume_in_new_processes_is_bit_exact(world, sources, tmp_path):
    path = str(tmp_path / "train")
    steps, k = 6, 3
    full = world(2).run(d.train_with_loader, path + "_unused", sources, steps, None, False)
    world(2).run(d.train_with_loader, path, sources, steps, k, False)
    fresh = WorldPool(2)  # resume in new processes
    try:
        resumed = fresh.run(d.train_with_loader, path, sources, steps, None, True)
    finally:
        fresh.close()
    for rank in range(2):
        assert resumed[rank]["losses"] == full[rank]["losses"][k:]
        assert resumed[rank]["draws"] == full[rank]["draws"][k:]


def test_per_rank_state_that_cannot_reshard_is_refused(world, tmp_path):
    world(2).run(d.per_rank_save, str(tmp_path / "differ"), True)
    world(2).run(d.per_rank_save, str(tmp_path / "same"), False)
    refused = world(3).run(d.per_rank_load, str(tmp_path / "differ"))
    assert all("cannot be split over 3 ranks" in r and "'counter'" in r for r in refused)
    assert world(3).run(d.per_rank_load, str(tmp_path / "same")) == ["value 7"] * 3
    assert world(2).run(d.per_rank_load, str(tmp_path / "differ")) == ["value 0", "value 1"]


def test_rng_state_round_trip():
    import random

    state = capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(()).item())
    restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == expected


def test_rng_state_through_a_checkpoint(tmp_path):
    torch.manual_seed(3)
    bcp.save(str(tmp_path / "c"), {"rng": bcp.RNGState()})
    expected = torch.rand(4)
    torch.manual_seed(4)
    bcp.load(str(tmp_path / "c"), {"rng": bcp.RNGState()})
    assert torch.equal(torch.rand(4), expected)
