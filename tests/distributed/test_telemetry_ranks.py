"""Every event of a save, a load and a manager names its rank, however the ranks were launched.

Without torchrun's ``RANK`` / ``WORLD_SIZE`` (``mp.spawn``, ``init_process_group(rank=...)``)
the events carried no rank, so the per-rank heatmap and the slow-rank rule, which keep only
events with a rank, silently lost the whole job.
"""

from __future__ import annotations

import os

import pytest

from telemetry.sinks import read_spool
from tests.support import storage_workloads as sw


@pytest.mark.parametrize("env", [
    pytest.param({"RANK": None, "WORLD_SIZE": None}, id="no-launcher-env"),
    pytest.param({"RANK": "7", "WORLD_SIZE": "9"}, id="launcher-env-disagrees"),
])
def test_every_save_and_load_event_names_the_process_groups_rank(world, tmp_path, env):
    root = str(tmp_path / "ckpt")
    results = world(4).run(sw.save_and_load_with_launcher_env, root, env)
    ranks = {r["pid"]: r["rank"] for r in results}
    started = min(r["started"] for r in results)
    events = [e for e in read_spool(os.environ["BCP_TELEMETRY_DIR"])
              if e.get("pid") in ranks and (root in str(e.get("checkpoint") or e.get("path") or "")
                                            or e["name"] == "train.step" and e["ts"] >= started)]
    names = {e["name"] for e in events}
    assert {"save", "save.write", "storage.write", "load", "load.read", "train.step"} <= names, names
    wrong = [(e["name"], e["pid"], e["rank"], e["world_size"]) for e in events
             if e["rank"] != ranks[e["pid"]] or e["world_size"] != 4]
    assert not wrong, wrong[:10]
    assert {e["rank"] for e in events} == {0, 1, 2, 3}


@pytest.mark.parametrize("shape,names,sub,preset,before,expect", [
    pytest.param((2, 2), ("dp", "tp"), None, {}, None, lambda c: {"dp": c[0], "tp": c[1], "pp": None},
                 id="dp-tp"),
    pytest.param((2, 2), ("pp", "tp"), "tp", {}, None, lambda c: {"dp": None, "tp": c[1], "pp": c[0]},
                 id="stage-sub-mesh"),
    pytest.param((2, 2), ("dp_replicate", "dp_shard"), None, {}, None,
                 lambda c: {"dp": 2 * c[0] + c[1], "tp": None, "pp": None}, id="hsdp"),
    pytest.param((2, 2), ("dp", "tp"), None, {"dp": 7}, None,
                 lambda c: {"dp": 7, "tp": c[1], "pp": None}, id="program-set-dp"),
    pytest.param((4,), ("cp",), None, {}, None, lambda c: {"dp": None, "tp": None, "pp": None},
                 id="unknown-name"),
    pytest.param((2, 2), ("pp", "tp"), "tp", {}, ("dp", "tp"),
                 lambda c: {"dp": None, "tp": c[1], "pp": c[0]}, id="after-a-dp-tp-mesh"),
])
def test_events_carry_the_ranks_place_in_the_device_mesh(world, tmp_path, shape, names, sub, preset,
                                                         before, expect):
    """Where the program set no dp / tp / pp, a save and a load of DTensors read them from the
    mesh (its whole mesh, so a stage's sub-mesh still gives pp) on every one of their events;
    what the program set stays, and what an earlier mesh gave and this one does not name is
    unset."""
    root = str(tmp_path / "ckpt")
    results = world(4).run(sw.save_and_load_on_mesh, root, shape, names, sub, preset, before)
    assert all(r["exact"] for r in results)
    wanted = {r["pid"]: expect(r["coordinate"]) for r in results}
    events = [e for e in read_spool(os.environ["BCP_TELEMETRY_DIR"])
              if e.get("pid") in wanted and e.get("checkpoint") == root]
    # every event, the first ones of each call included (the load's metadata read, the save's
    # first storage calls come before the state is flattened)
    names = {e["name"] for e in events}
    assert {"save", "save.collect", "save.write", "load", "load.metadata", "load.read"} <= names, names
    wrong = [(e["name"], e["rank"], {k: e[k] for k in ("dp", "tp", "pp")}, wanted[e["pid"]])
             for e in events if {k: e[k] for k in ("dp", "tp", "pp")} != wanted[e["pid"]]]
    assert not wrong, wrong[:10]
