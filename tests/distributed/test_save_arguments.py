"""Every rank of a save passes the same arguments, or no rank's save succeeds.

Ranks that passed different paths (a per-rank timestamp in the name) or steps each got a
``SaveResult``, while only the coordinator's path was committed, under its step: rank 1's
checkpoint did not exist."""

from __future__ import annotations

import os

from tests.support import save_workloads as sw


def test_a_save_whose_ranks_disagree_on_its_arguments_commits_nothing(world, tmp_path):
    root = str(tmp_path)
    results = world(2).run(sw.save_with_arguments_per_rank, root)
    for rank, r in enumerate(results):
        refused = "refused: the ranks called save() with different arguments:"
        assert r["per-rank path"].startswith(f"{refused} path"), r
        assert r["per-rank step, cached plan"].startswith(f"{refused} step"), r
        assert r["same, fresh plan"] == r["same, cached plan"] == "committed", (rank, r)
        assert r["exact"] is True
    assert not os.path.exists(f"{root}/ckpt_r0") and not os.path.exists(f"{root}/ckpt_r1")
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["ckpt", "latest"]


def test_state_only_some_ranks_saved_is_missing_on_the_others_not_corrupt(world, tmp_path):
    """The library writes such a checkpoint without complaint; loading it back on the same
    ranks called it "damaged or hostile"."""
    results = world(2).run(sw.extra_on_rank_0_only, str(tmp_path / "c"))
    assert [r["strict"] for r in results] == ["RankFailedError", "MissingKeysError"]
    assert results[0]["value"] == {"a": 1} and results[0]["missing"] == []
    assert results[1]["value"] == {"a": -1} and results[1]["missing"] == ["extra"]
