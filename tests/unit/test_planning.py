"""Global save planning on synthetic plans: dedup, balance and validation."""

from __future__ import annotations

import pytest

from bytecheckpoint.errors import PlanningError
from bytecheckpoint.format.boxes import Box, full_box
from bytecheckpoint.planning.global_plan import LocalSavePlan, WriteItem, plan_save


def _replicated_plans(world: int, shapes: dict[str, tuple[int, ...]]) -> list[LocalSavePlan]:
    items = [WriteItem(k, "float32", s, full_box(s)) for k, s in shapes.items()]
    return [LocalSavePlan(r, list(items)) for r in range(world)]


def test_replicated_tensors_are_written_once_and_balanced():
    shapes = {"embed": (50_000, 256), "head": (50_000, 256), "ln": (256,)}
    shapes |= {f"layer{i}.w": (1024, 256) for i in range(12)}
    plan = plan_save(_replicated_plans(8, shapes))
    written = [it for items in plan.assignments for it in items]
    for key, shape in shapes.items():  # each tensor covered exactly once
        boxes = [it.box for it in written if it.key == key]
        assert sum(b.numel for b in boxes) == Box((0,) * len(shape), shape).numel
    loads = [sum(it.nbytes for it in items) for items in plan.assignments]
    assert max(loads) / (sum(loads) / len(loads)) <= 1.05, loads


def test_unique_shards_stay_with_their_holder():
    plans = [LocalSavePlan(r, [WriteItem("w", "float32", (8, 4), Box((2 * r, 0), (2, 4)))])
             for r in range(4)]
    plan = plan_save(plans)
    assert [[it.box for it in items] for items in plan.assignments] == [
        [Box((2 * r, 0), (2, 4))] for r in range(4)
    ]


def test_partial_replicas_go_to_the_least_loaded_holder():
    # Ranks 0/1 replicate box A (dp), ranks 2/3 replicate box B; rank 0 also holds a big unique box.
    plans = [
        LocalSavePlan(0, [WriteItem("a", "float32", (4, 4), Box((0, 0), (2, 4))),
                          WriteItem("big", "float32", (1000,), Box((0,), (1000,)))]),
        LocalSavePlan(1, [WriteItem("a", "float32", (4, 4), Box((0, 0), (2, 4)))]),
        LocalSavePlan(2, [WriteItem("a", "float32", (4, 4), Box((2, 0), (2, 4)))]),
        LocalSavePlan(3, [WriteItem("a", "float32", (4, 4), Box((2, 0), (2, 4)))]),
    ]
    plan = plan_save(plans)
    assert [it.key for it in plan.assignments[0]] == ["big"]
    assert [it.box for it in plan.assignments[1]] == [Box((0, 0), (2, 4))]
    assert len(plan.assignments[2]) + len(plan.assignments[3]) == 1


def test_inconsistent_or_incomplete_plans_are_rejected():
    bad_shape = [LocalSavePlan(0, [WriteItem("w", "float32", (4,), full_box((4,)))]),
                 LocalSavePlan(1, [WriteItem("w", "float32", (5,), full_box((5,)))])]
    with pytest.raises(PlanningError, match="w: rank 0 has dtype float32 shape \\(4,\\), rank 1"):
        plan_save(bad_shape)
    gap = [LocalSavePlan(0, [WriteItem("w", "float32", (4,), Box((0,), (2,)))])]
    with pytest.raises(PlanningError, match="cover 2 of 4"):
        plan_save(gap)
    overlap = [LocalSavePlan(0, [WriteItem("w", "float32", (4,), Box((0,), (3,)))]),
               LocalSavePlan(1, [WriteItem("w", "float32", (4,), Box((2,), (2,)))])]
    with pytest.raises(PlanningError, match="overlap"):
        plan_save(overlap)
