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
