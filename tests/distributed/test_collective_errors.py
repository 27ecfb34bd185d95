"""A failure on one rank reaches every rank as an exception; nothing is committed."""

from __future__ import annotations

import os

from tests.support import workloads as w


def test_inconsistent_shapes_fail_on_every_rank(world, tmp_path):
    results = world(2).run(w.mismatched_save, str(tmp_path))
    assert all(r.startswith("PlanningError") and "model/weight" in r for r in results), results
    assert not os.path.exists(tmp_path / "bad")


def test_one_rank_failing_fails_the_save_everywhere(world, tmp_path):
    results = world(2).run(w.failing_object_save, str(tmp_path))
    assert results == ["RankFailedError", "UnsupportedStateError"]
    assert not os.path.exists(tmp_path / "bad2")
    assert [n for n in os.listdir(tmp_path) if "staging" in n] == []
