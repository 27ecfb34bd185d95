"""Saves and loads on 4 and 2 gloo ranks with faults injected into every storage call.

Runs on each backend of ``storage_root`` (local disk, shm://, S3 on moto_server).
"""

from __future__ import annotations

import pytest

import bytecheckpoint as bcp
from bytecheckpoint.commit.integrity import read_latest, resolve
from bytecheckpoint.storage import open_storage
from tests.support import storage_workloads as sw
from tests.support import workloads as w
from tests.support.helpers import assert_same_state

# Many attempts with short waits: at 20% failures, 12 failures in a row has odds of 4e-9.
RETRY_ENV = {"BCP_STORAGE_RETRY_ATTEMPTS": "12", "BCP_STORAGE_RETRY_BASE_S": "0.005",
             "BCP_STORAGE_RETRY_MAX_S": "0.05"}


@pytest.fixture
def faulty_ranks(world):
    """Clears faults on the 4- and 2-rank pools after the test, whatever happened."""
    yield
    for n in (4, 2):
        world(n).run(sw.set_faults, None)


def test_transient_faults_on_a_fifth_of_calls_still_save_and_load_bit_exact(world, storage_root,
                                                                              faulty_ranks):
    root = storage_root("flaky")
    spec = "fail_fraction=0.2;seed=11"
    world(4).run(sw.set_faults, spec, RETRY_ENV)
    saved = world(4).run(w.fsdp2_train_save, root, 2)
    injected_on_save = sum(world(4).run(sw.injected))
    world(2).run(sw.set_faults, spec + ";seed=12", RETRY_ENV)
    loaded = world(2).run(w.fsdp2_load, root)
    injected_on_load = sum(world(2).run(sw.injected))
    assert injected_on_save > 10 and injected_on_load > 5, (injected_on_save, injected_on_load)
    for r in loaded:
        assert_same_state(saved[0]["ref"], r["state"])


def test_permanent_failure_fails_clearly_commits_nothing_and_keeps_previous(world, storage_root,
                                                                             faulty_ranks):
    root = storage_root("perm")
    first = world(4).run(w.fsdp2_train_save, root, 1)
    # Rank 2 is refused permission on its 2nd buffer write of step_2.
    world(4).run(sw.set_faults, "permanent=1;fail_call=2;ops=write;ranks=2;path=step_2", RETRY_ENV)
    results = world(4).run(sw.save_reporting_error, root, 2)
    errors = [r.get("error", "") for r in results]
    assert all(errors), results
    assert "permission denied" in errors[2] and "PermanentStorageError" in errors[2]
    assert all("rank 2" in e or "permission denied" in e for e in errors), errors
    world(4).run(sw.set_faults, None)
    with pytest.raises(bcp.NotACheckpointError):
        resolve(f"{root}/step_2")
    storage, path = open_storage(root)
    assert read_latest(storage, path).name == "step_1"
    assert [n for n in storage.list_dir(path) if "step_2" in n] in ([], ["step_2"])
    if storage.exists(f"{path}/step_2"):  # object stores: whatever is left holds no commit
        assert not storage.exists(f"{path}/step_2/metadata.msgpack")
    for r in world(2).run(w.fsdp2_load, root):
        assert_same_state(first[0]["ref"], r["state"])
