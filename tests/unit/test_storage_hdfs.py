"""The HDFS backend's own logic, run against an in-memory stand-in of ``hdfs_native.Client``.

What this proves: the backend maps paths (``namenode:port/abs/path``) and calls the client's
documented methods correctly; ranged reads split into parts and reassemble; commits by
rename; retries transient client errors and fails at once on permission errors; and a full
single-process save and load round-trips bit for bit through it.

What it does not prove: anything about a real name node or datanodes — the wire protocol,
hdfs-native's behaviour on a live cluster, performance, the HDFS atomicity of rename under
concurrent clients, or authentication. No HDFS cluster can run here; the docker-compose
setup of a later issue brings one.
"""

from __future__ import annotations

import os

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import PermanentStorageError, TransientStorageError
from bytecheckpoint.storage import CommitMode, register_backend
from bytecheckpoint.storage.config import RetrySettings, TransferSettings
from bytecheckpoint.storage.hdfs import HdfsStorage
from bytecheckpoint.storage.managed import ManagedStorage
from tests.support.hdfs_standin import StandInClient

FAST_RETRY = RetrySettings(attempts=4, base_s=0.001, max_s=0.005, deadline_s=5)


@pytest.fixture
def cluster():
    clients: dict[str | None, StandInClient] = {}

    def factory(url: str | None) -> StandInClient:
        return clients.setdefault(url, StandInClient(url))

    return clients, factory


def test_paths_writes_ranged_parallel_reads_and_rename(cluster):
    clients, factory = cluster
    hdfs = HdfsStorage(transfer=TransferSettings(part_bytes=1000, threads=3), client_factory=factory)
    assert hdfs.commit_mode is CommitMode.RENAME
    data = os.urandom(5500)
    writer = hdfs.open_writer("nn:8020/user/a/.ck.staging-1/f")
    writer.write(data[:3000])
    writer.write(memoryview(data)[3000:])
    assert writer.commit() == 5500
    client = clients["hdfs://nn:8020"]
    assert client.files["/user/a/.ck.staging-1/f"] == data
    buf = bytearray(4200)
    assert hdfs.read_into("nn:8020/user/a/.ck.staging-1/f", 700, memoryview(buf)) == 4200
    assert buf == data[700:4900]
    # 4200 bytes on 3 threads: one contiguous 1400-byte part per thread (parts >= 1000 bytes)
    assert sum(1 for m, _ in client.calls if m == "read") == 3
    short = bytearray(1000)
    assert hdfs.read_into("nn:8020/user/a/.ck.staging-1/f", 5000, memoryview(short)) == 500
    hdfs.rename("nn:8020/user/a/.ck.staging-1", "nn:8020/user/a/ck")
    assert hdfs.list_dir("nn:8020/user/a") == ["ck"] and hdfs.size("nn:8020/user/a/ck/f") == 5500
    with pytest.raises(FileNotFoundError):
        hdfs.size("nn:8020/user/a/ck/nope")
    with pytest.raises(IsADirectoryError):
        hdfs.size("nn:8020/user/a/ck")
    hdfs.delete("nn:8020/user/a")
    assert not hdfs.exists("nn:8020/user/a/ck/f") and hdfs.list_dir("nn:8020/user/a") == []


def test_transient_client_errors_are_retried_and_permission_errors_are_not(cluster):
    clients, factory = cluster
    hdfs = ManagedStorage(HdfsStorage(client_factory=factory), FAST_RETRY)
    hdfs.write_bytes("nn:1/x/f", b"abc")
    client = clients["hdfs://nn:1"]
    client.failures["get_file_info"] = [OSError("connection reset by datanode"), ConnectionError("refused")]
    assert hdfs.size("nn:1/x/f") == 3
    client.failures["mkdirs"] = [PermissionError("Permission denied: user=bob, access=WRITE")]
    with pytest.raises(PermanentStorageError, match="permission denied.*grant this user"):
        hdfs.makedirs("nn:1/y")
    client.failures["read"] = [OSError("timed out")] * 10
    with pytest.raises(TransientStorageError, match="failed after 4 attempts"):
        hdfs.read("nn:1/x/f")


def test_a_failed_stream_write_cannot_be_repeated(cluster):
    clients, factory = cluster
    hdfs = ManagedStorage(HdfsStorage(client_factory=factory), FAST_RETRY)
    writer = hdfs.open_writer("nn:1/x/f")
    clients["hdfs://nn:1"].failures["write"] = [OSError("pipeline failed")]
    with pytest.raises(PermanentStorageError, match="cannot be completed"):
        writer.write(b"data")
    writer.abort()
    assert not hdfs.exists("nn:1/x/f")


def test_save_and_load_round_trip_through_the_backend(cluster, monkeypatch):
    _, factory = cluster
    register_backend("hdfs-standin", lambda: _Named(factory), clobber=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(37, 11)
    bcp.save("hdfs-standin://nn:8020/ckpt/step_1", {"model": model}, step=1)
    fresh = torch.nn.Linear(37, 11)
    bcp.load("hdfs-standin://nn:8020/ckpt", {"model": fresh})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert bcp.verify("hdfs-standin://nn:8020/ckpt") == []


class _Named(HdfsStorage):
    scheme = "hdfs-standin"

    def __init__(self, factory) -> None:
        super().__init__(client_factory=factory)

    def url(self, path: str) -> str:
        return f"hdfs-standin://{path}"
