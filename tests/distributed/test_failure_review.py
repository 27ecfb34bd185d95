"""One rank failing in a load or a save: every other rank gets a named error that says which
rank failed and why, nothing hangs, nothing is committed, and the group's next load or save
gives exact values (no message of the failed operation is left to pair with its own)."""

from __future__ import annotations

import bytecheckpoint as bcp
from tests.support import failure_review_workloads as fw
from tests.support.dist import free_port


def test_an_interrupt_or_a_read_error_on_one_rank_reaches_every_rank_and_leaves_the_group_exact(
        world, tmp_path):
    # Was: a KeyboardInterrupt on rank 1 skipped the load's collectives, so rank 0 waited in
    # its all-gather until the group's timeout (rank 1's next load paired with it), and an
    # I/O error on rank 1 reached rank 0 as "rank 1 failed", without the error.
    r0, r1 = world(2).run(fw.load_failures, str(tmp_path))
    assert r1["plan"] == "KeyboardInterrupt: stop in plan", r1
    assert r1["copy"] == "KeyboardInterrupt: stop in copy", r1
    assert r1["eio"].startswith("StorageIOError") and "EIO" in r1["eio"], r1
    for case, why in (("plan", "KeyboardInterrupt: stop in plan"),
                      ("copy", "KeyboardInterrupt: stop in copy"), ("eio", "Input/output error (EIO)")):
        assert r0[case].startswith("RankFailedError") and "rank 1" in r0[case] and why in r0[case], r0
    for r in (r0, r1):
        assert [r[k] for k in ("plan then", "copy then", "eio then", "save then")] == [True] * 4, r


def test_an_interrupted_write_on_one_rank_commits_nothing_and_the_group_saves_again(world, tmp_path):
    # Was: rank 0 waited in the commit round until the group's timeout.
    r0, r1 = world(2).run(fw.save_interrupted, str(tmp_path))
    assert r1["save"] == "KeyboardInterrupt: stop in write", r1
    assert r0["save"].startswith("RankFailedError") and "rank 1: KeyboardInterrupt" in r0["save"], r0
    for r in (r0, r1):
        assert r["listing"] == ["latest", "step_1"], r
        assert r["latest exact"] and r["then exact"], r


def test_a_rank_that_dies_in_a_load_or_a_save_gives_the_other_a_named_error_at_once(tmp_path):
    # Was: gloo's bare RuntimeError ("Connection closed by peer"), then a second one from the
    # load's closing collective.
    for moment in ("load", "save"):
        root = tmp_path / moment
        root.mkdir()
        outcomes = fw.dying_world(str(root), moment, free_port())
        assert list(outcomes) == [0], outcomes
        outcome, seconds = outcomes[0]
        assert outcome.startswith("ProcessGroupError") and "restart the job" in outcome, outcome
        assert seconds < 30, outcomes  # the closed connection, not the group's 60 s timeout
    root = tmp_path / "save"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "latest", "rank0.outcome", "step_1"]
    got = fw.module(None)
    assert bcp.load(str(root), {"model": got}).step == 1 and fw.exact(got, 1)


def test_a_rank_that_cannot_find_a_box_s_bytes_fails_the_save_on_every_rank(world, tmp_path):
    # Was: the error left rank 1's save at once, and rank 0 waited in the write round until
    # the group's timeout (found by the resharding fuzzer: a 0-d tensor one rank held none of).
    r0, r1 = world(2).run(fw.save_sources_fail, str(tmp_path))
    for mode in ("sync", "async"):
        assert "no bytes for a box" in r1[mode], r1
        assert r0[mode].startswith("RankFailedError") and "rank 1" in r0[mode], r0
        assert "no bytes for a box" in r0[mode], r0
    for r in (r0, r1):
        assert r["listing"] == ["latest", "step_1"], r  # nothing of step_2 committed
        assert r["then exact"], r
