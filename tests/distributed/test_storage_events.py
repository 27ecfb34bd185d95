"""Every storage operation of a save is one I/O event in the telemetry spool."""

from __future__ import annotations

import os
import re

import telemetry
from bytecheckpoint.commit.integrity import resolve
from telemetry.sinks import read_spool
from tests.support import storage_workloads as sw
from tests.support import workloads as w


def test_write_events_of_a_save_add_up_to_the_checkpoint_size(world, storage_root):
    root = storage_root("events")
    world(4).run(w.fsdp2_train_save, root, 1)
    world(4).run(sw.flush_telemetry)
    storage, path = resolve(root)
    on_disk = sum(storage.size(f"{path}/{name}") for name in storage.list_dir(path))
    telemetry.flush()
    # Files are written under a staging directory (renamed at commit) or in place (object stores).
    inside = re.compile(re.escape(storage.url(os.path.dirname(path))) + r"/(\.step_1\.staging-[^/]+|step_1)/")
    events = [e for e in read_spool(os.environ["BCP_TELEMETRY_DIR"]) if inside.search(e.get("path") or "")]
    writes = [e for e in events if e["name"] == "storage.write"]
    assert writes and all(e["outcome"] == "ok" and e["backend"] == storage.scheme for e in writes)
    assert sum(e["bytes"] for e in writes) == on_disk
    commits = [e for e in events if e["name"] == "storage.commit"]
    assert sum(e["attrs"]["file_bytes"] for e in commits) == on_disk
    assert {e["rank"] for e in writes} == {0, 1, 2, 3}
    assert all(e["op"] == "write" and e["attempt"] == 1 and e["duration_s"] >= 0 for e in writes)
