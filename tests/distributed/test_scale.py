"""Scale: planning complexity, the simulator, and tree coordination at 16 real processes."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator

import pytest

from bytecheckpoint.errors import PlanningError
from bytecheckpoint.format.boxes import Box, coverage_problem, flat_range_boxes, untiled_tensors
from bytecheckpoint.format.metadata import CheckpointMetadata
from bytecheckpoint.planning.global_plan import LocalSavePlan, WriteItem, plan_save
from bytecheckpoint.planning.simulate import (
    Layout,
    ModelSpec,
    count_fs_ops,
    growth_exponent,
    local_plans,
    nlogn_exponent,
    simulate,
)
from bytecheckpoint.runtime.comm import tree_layout, tree_settings
from tests.support.dist import WorldPool

TINY = ModelSpec(layers=5, hidden=32, ffn=48, vocab=40, kv_heads=2, head_dim=8)


# -- the tree -------------------------------------------------------------------------------


@pytest.mark.parametrize("world,host,fanout", [(1, 8, 16), (16, 4, 2), (37, 4, 3), (1000, 8, 16), (9, 1, 2)])
def test_tree_layout_is_a_tree_over_every_rank(world, host, fanout):
    nodes = tree_layout(world, host, fanout)
    assert nodes[0].parent is None and nodes[0].subtree == tuple(range(world))
    for r, node in enumerate(nodes):
        if r:
            assert node.parent is not None and node.parent < r
            assert r in nodes[node.parent].children
        assert node.subtree == tuple(sorted([r, *(x for c in node.children for x in nodes[c].subtree)]))
        # a leader hears from its host's ranks and at most fanout-1 leaders per level above
        assert len(node.children) <= (host - 1) + (fanout - 1) * 8
    if world > 1 and host > 1:  # ranks of one host hang under their host's first rank
        assert all(nodes[r].parent == (r // host) * host for r in range(world) if r % host)


def test_tree_settings_threshold_and_overrides(monkeypatch):
    monkeypatch.delenv("BCP_COMM_TREE", raising=False)
    monkeypatch.delenv("BCP_COMM_HOST_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert tree_settings(16) is None  # small worlds stay flat
    assert tree_settings(4096) == (8, 16)
    monkeypatch.setenv("BCP_COMM_TREE", "1")
    monkeypatch.setenv("BCP_COMM_HOST_SIZE", "4")
    monkeypatch.setenv("BCP_COMM_FANOUT", "2")
    assert tree_settings(16) == (4, 2)
    assert tree_settings(16, tree=False) is None
    monkeypatch.setenv("BCP_COMM_TREE", "0")
    assert tree_settings(100_000) is None


# -- planning at scale, on synthetic plans ------------------------------------------------------


def test_untiled_tensors_agrees_with_the_per_tensor_check():
    rng = random.Random(3)
    for _ in range(300):
        shapes, tix, offs, lens, boxes = [], [], [], [], []
        for t in range(rng.randint(1, 4)):
            shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 3)))
            numel = 1
            for s in shape:
                numel *= s
            cuts = sorted(rng.sample(range(1, numel), min(numel - 1, rng.randint(0, 3)))) if numel > 1 else []
            mine = [b for a, z in zip([0, *cuts], [*cuts, numel]) for b in flat_range_boxes(shape, a, z)]
            if mine and rng.random() < 0.5:  # break it: drop, duplicate, shift or grow a box
                i = rng.randrange(len(mine))
                b = mine[i]
                how = rng.choice(["drop", "dup", "shift", "grow"])
                if how == "drop":
                    mine.pop(i)
                elif how == "dup":
                    mine.append(b)
                elif b.ndim:
                    d = rng.randrange(b.ndim)
                    o, n = list(b.offsets), list(b.lengths)
                    (o if how == "shift" else n)[d] += 1
                    mine[i] = Box(tuple(o), tuple(n))
            shapes.append(shape)
            boxes.append(mine)
            for b in mine:
                tix.append(t)
                offs.append(b.offsets)
                lens.append(b.lengths)
        want = {t for t, (s, bs) in enumerate(zip(shapes, boxes)) if coverage_problem(s, bs) is not None}
        assert untiled_tensors(shapes, tix, offs, lens) == want, (shapes, boxes)


def test_simulated_layout_plans_every_element_once_and_balances():
    layout = Layout(tp=2, pp=3, dp=4, ranks_per_host=4)
    plans = local_plans(TINY, layout)
    assert len(plans) == 24
    plan = plan_save(plans)
    written: dict[str, int] = {}
    for items in plan.assignments:
        for it in items:
            written[it.key] = written.get(it.key, 0) + it.box.numel
    for key, (_, shape) in plan.tensors.items():
        n = 1
        for s in shape:
            n *= s
        assert written[key] == n, key
    # every ZeRO slice stays with its only holder; weights are spread over their replicas
    assert max(plan.planned_bytes) <= 2.5 * (sum(plan.planned_bytes) / len(plan.planned_bytes))


def test_a_missing_rank_is_named_by_the_fast_check():
    plans = local_plans(TINY, Layout(tp=2, pp=2, dp=2))
    dropped = plans[:5] + [LocalSavePlan(5, [])] + plans[6:]
    with pytest.raises(PlanningError, match="do not tile"):
        plan_save(dropped)
    bad = [LocalSavePlan(0, [WriteItem("w", "float32", (4, 4), Box((0, 0), (4, 4)))]),
           LocalSavePlan(1, [WriteItem("w", "float32", (4, 4), Box((2, 0), (2, 4)))])]
    with pytest.raises(PlanningError, match="overlap"):
        plan_save(bad)


def test_simulator_reports_stages_files_and_a_loadable_metadata():
    layout = Layout(tp=2, pp=3, dp=4, ranks_per_host=4)
    report = simulate(TINY, layout, memory=True)
    assert set(report.stages) == {"plan", "template", "build", "encode", "decode", "cached"}
    assert all(s.seconds >= 0 and s.peak_mib is not None for s in report.stages.values())
    assert report.metadata_boxes > 0 and report.metadata_bytes > 0
    # one file per rank and kind, against one per host and kind
    assert report.files["rank"].files == 24 * 3 + 1 and report.files["host"].files == 6 * 3 + 1
    assert report.files["host"].total < report.files["rank"].total
    host = simulate(TINY, layout, files_per="host")
    assert host.metadata_boxes == report.metadata_boxes


def test_host_files_metadata_decodes_and_validates():
    from bytecheckpoint.planning.save_metadata import build_metadata, metadata_template
    from bytecheckpoint.planning.simulate import synthetic_writes

    layout = Layout(tp=2, pp=2, dp=3, ranks_per_host=4)
    plan = plan_save(local_plans(TINY, layout))
    for mode in ("rank", "host"):
        writes = synthetic_writes(plan, layout, files_per=mode)
        meta = build_metadata(metadata_template(plan, writes), writes, framework="megatron",
                              world_size=layout.world, layout={}, step=1, user_metadata={},
                              chunk_bytes=4 << 20)
        back = CheckpointMetadata.from_bytes(meta.to_bytes())  # bounds-checks every box
        assert len(back.boxes) == len(meta.boxes)


def test_fs_ops_and_growth_exponents():
    ops = count_fs_ops([1, 200 << 20], block_bytes=128 << 20, metadata_bytes=10)
    assert ops.files == 3 and ops.blocks == 1 + 2 + 1
    assert growth_exponent(1000, 1.0, 4000, 4.0) == pytest.approx(1.0)
    assert 1.0 < nlogn_exponent(4096, 16384) < 1.15


def test_planning_grows_no_faster_than_n_log_n_on_a_mid_size_model():
    # A 1/16-scale check of the benchmark's claim that runs in the suite (seconds, not minutes).
    spec = ModelSpec(layers=16, hidden=1024, ffn=2816, vocab=8192, kv_heads=4, head_dim=64)
    times = {}
    for world in (256, 1024):
        plans = local_plans(spec, Layout.for_world(world, tp=4, pp=4))
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            plan_save(plans)
            best = min(best, time.perf_counter() - t)
        times[world] = best
    # generous bound for a shared machine: n log n gives ~1.1; a quadratic step gives ~2
    assert growth_exponent(256, times[256], 1024, times[1024]) < 1.6, times


# -- 16 real processes: the tree against the flat version ---------------------------------------


@pytest.fixture(scope="module")
def sixteen() -> Iterator[WorldPool]:
    """16 gloo ranks, started for this module only and shut down after it."""
    pool = WorldPool(16, timeout=240)
    yield pool
    pool.close()


@pytest.mark.skipif(sys.platform != "linux", reason="16 local gloo processes")
def test_tree_coordination_at_16_processes_matches_flat(sixteen, tmp_path):
    from tests.support import scale_workloads as sw
    results = sixteen.run(sw.tree_matches_flat, str(tmp_path))
    flat = [r["flat"] for r in results]
    tree = [r["tree"] for r in results]
    assert tree == flat  # every collective, every rank, error paths included
    assert flat[0]["gather"] == [(r, "x" * r) for r in range(16)]
    assert [f["scatter"]["to"] for f in flat] == list(range(16))
    assert all(f["all_gather"] == [r * r for r in range(16)] for f in flat)
    assert all(f["check_all_ok"] == "passed" for f in flat)
    assert all(f["check_all"][0] == "RankFailedError" for f in flat)
    assert flat[0]["check_all"][2] == {7: "ValueError: disk full"}
    # the flat version sends nothing point-to-point; in the tree no rank hears from more
    # than its children (3 host ranks + 1 leader per level), the coordinator included
    assert all(r["flat_sends"] == 0 for r in results)
    assert results[0]["node"].children == (1, 2, 3, 4, 8)
    assert max(len(r["node"].children) for r in results) == 5
    assert all(r["tree_sends"] > 0 for r in results[1:])
    # whole saves through the tree: same metadata as flat, cache hit, async, loads
    assert all(r["save_sends"] > 0 for r in results)
    assert all(r["cached"] == [False, False, True, True] for r in results)
    assert all(all(r["loaded"].values()) for r in results)
    meta = results[0]["metadata"]
    assert meta["tree"] == meta["flat"]
