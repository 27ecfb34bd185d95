"""HDFS mode of the cooling service, against the in-memory HDFS stand-in.

What this proves: the same policy drives HDFS storage policies; a cooled checkpoint keeps
its path and loads bit for bit; a move interrupted after any step is finished by the next
pass from its marker; a second pass changes nothing; the Hadoop command lines are the ones
an operator would type, and their failures read clearly. What it does not prove: that a
real name node and the HDFS Mover move the blocks (no cluster runs here).
"""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.storage import register_backend
from bytecheckpoint.storage.hdfs import HdfsStorage
from storage_tiering import load_config, run_once
from storage_tiering.hdfs import HdfsCli
from storage_tiering.mover import MoveError
from tests.support.hdfs_standin import StandInClient

ROOT = "hdfs-standin://nn:8020/ckpt"


class _Named(HdfsStorage):
    scheme = "hdfs-standin"

    def url(self, path: str) -> str:
        return f"hdfs-standin://{path}"


class RecordingAdmin:
    def __init__(self) -> None:
        self.policies: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []

    def get_policy(self, url: str) -> str:
        return self.policies.get(url, "HOT")

    def set_policy(self, url: str, policy: str) -> None:
        self.calls.append(("set", url))
        self.policies[url] = policy

    def migrate(self, url: str) -> None:
        self.calls.append(("migrate", url))


@pytest.fixture
def cluster():
    client = StandInClient("nn:8020")
    register_backend("hdfs-standin", lambda: _Named(client_factory=lambda url: client), clobber=True)
    models = {}
    for step in (1, 2, 3):
        torch.manual_seed(step)
        models[step] = torch.nn.Linear(64, 32)
        bcp.save(f"{ROOT}/run/step_{step}", {"model": models[step]}, step=step)
    return client, models


def _loads_exactly(step: int, model: torch.nn.Module) -> None:
    fresh = torch.nn.Linear(64, 32)
    bcp.load(f"{ROOT}/run/step_{step}", {"model": fresh})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_old_checkpoints_get_the_cold_policy_in_place_and_a_second_pass_does_nothing(cluster):
    _, models = cluster
    admin = RecordingAdmin()
    config = load_config(env={}, hot=ROOT, cool_after="1d", keep_newest=1)
    report = run_once(config, admin=admin, now=time.time() + 30 * 86400)
    assert sorted(r.checkpoint for r in report.cooled) == [f"{ROOT}/run/step_1", f"{ROOT}/run/step_2"]
    assert admin.policies == {f"{ROOT}/run/step_1": "COLD", f"{ROOT}/run/step_2": "COLD"}
    assert [c for c, _ in admin.calls] == ["set", "migrate", "set", "migrate"]
    for step, model in models.items():
        _loads_exactly(step, model)
        assert bcp.verify(f"{ROOT}/run/step_{step}") == []
    again = run_once(config, admin=admin, now=time.time() + 30 * 86400)
    assert not again.changed and len(admin.calls) == 4
    assert {d.checkpoint.name: d.reason for d in again.decisions}["step_1"] == "already cold"


def test_retention_checks_again_before_it_deletes(cluster, monkeypatch):
    """The Mover runs for hours between a pass's scan and its deletions: a checkpoint pinned,
    saved again at its path (``overwrite=True``, now named by ``latest``), or holding a file
    that is not its own since the scan is kept, and still loads; the others go."""
    import storage_tiering.service as service
    from bytecheckpoint.commit.leases import pin

    _, models = cluster
    bcp.save(f"{ROOT}/run/step_4", {"model": models[3]}, step=4)
    replacement = torch.nn.Linear(64, 32)
    decide = service.decide

    def decide_then_change(*args, **kwargs):
        decisions = decide(*args, **kwargs)
        pin(f"{ROOT}/run/step_1", "a person keeps it")
        bcp.save(f"{ROOT}/run/step_2", {"model": replacement}, step=9, overwrite=True)
        return decisions

    monkeypatch.setattr(service, "decide", decide_then_change)
    config = load_config(env={}, hot=ROOT, cool_after="1d", delete_after="60d", keep_newest=1)
    report = run_once(config, admin=RecordingAdmin(), now=time.time() + 90 * 86400)
    assert sorted(d.checkpoint.name for d in report.decisions if d.action == "delete") == [
        "step_1", "step_2", "step_3"]
    assert report.deleted == [f"{ROOT}/run/step_3"]
    assert "pinned" in report.failed[f"{ROOT}/run/step_1"]
    assert "replaced by a new save" in report.failed[f"{ROOT}/run/step_2"]
    _loads_exactly(1, models[1])
    _loads_exactly(2, replacement)
    latest = torch.nn.Linear(64, 32)
    assert bcp.load(f"{ROOT}/run", {"model": latest}).step == 9


@pytest.mark.parametrize("step", ["policy", "migrated"])
def test_an_interrupted_move_is_finished_by_the_next_pass(cluster, step):
    client, models = cluster
    admin = RecordingAdmin()
    config = load_config(env={}, hot=ROOT, cool_after="1d", keep_newest=2)

    def crash(name: str) -> None:
        if name == step:
            raise RuntimeError("killed")  # cool() has no cleanup, so this leaves what a kill does

    first = run_once(config, admin=admin, now=time.time() + 30 * 86400, on_step=crash)
    assert list(first.failed) == [f"{ROOT}/run/step_1"]
    assert any(".step_1.tiering-" in p for p in client.files)
    _loads_exactly(1, models[1])
    second = run_once(config, admin=admin, now=time.time() + 30 * 86400)
    assert second.recovered == 1 and not second.failed
    assert not any(".tiering-" in p for p in client.files)
    assert admin.calls.count(("migrate", f"{ROOT}/run/step_1")) == 1 + (step == "migrated")
    _loads_exactly(1, models[1])


def test_corruption_after_the_mover_is_reported_and_retried(cluster):
    client, _ = cluster
    admin = RecordingAdmin()

    def corrupt(url: str) -> None:
        name = next(p for p in client.files if "/step_1/model-" in p)
        data = bytearray(client.files[name])
        data[-1] ^= 0xFF
        client.files[name] = bytes(data)

    admin.migrate = corrupt  # type: ignore[method-assign]
    report = run_once(load_config(env={}, hot=ROOT, cool_after="1d", keep_newest=2), admin=admin,
                      now=time.time() + 30 * 86400)
    assert "fails the checkpoint's checksums" in report.failed[f"{ROOT}/run/step_1"]
    assert any(".step_1.tiering-" in p for p in client.files)  # the next pass checks again


def test_hadoop_command_lines_and_their_errors():
    seen = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        out = ("The storage policy of hdfs://nn/x:\nBlockStoragePolicy{COLD:2, storageTypes=[ARCHIVE], "
               "creationFallbacks=[], replicationFallbacks=[]}\n")
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    cli = HdfsCli("hdfs", run=run)
    assert cli.get_policy("hdfs://nn/x") == "COLD"
    cli.set_policy("hdfs://nn/x", "COLD")
    cli.migrate("hdfs://nn/x")
    assert seen[1:] == [["hdfs", "storagepolicies", "-setStoragePolicy", "-path", "hdfs://nn/x", "-policy",
                         "COLD"], ["hdfs", "mover", "-p", "hdfs://nn/x"]]
    failing = HdfsCli("hdfs", run=lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 255, stdout="", stderr="mover: Permission denied: user=bob"))
    with pytest.raises(MoveError, match="exit 255.*Permission denied"):
        failing.migrate("hdfs://nn/x")
    with pytest.raises(MoveError, match="not on PATH"):
        HdfsCli("/nonexistent/hdfs").migrate("hdfs://nn/x")
