"""Requests an S3 load sends, counted by a proxy in front of the test S3 server: a run of small
tensors read back to back is one object handle (one HEAD) and its ranged GETs, not a HEAD and a
GET per tensor."""

from __future__ import annotations

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.storage import Storage, open_storage
from bytecheckpoint.storage.config import TransferSettings
from bytecheckpoint.storage.s3 import S3Storage
from tests.support.s3_busy_proxy import proxied_s3_root


@pytest.fixture
def counted_s3(monkeypatch):
    with proxied_s3_root(monkeypatch, "reads") as found:
        yield found


def test_s3_a_load_of_small_tensors_reads_each_file_with_a_few_requests(counted_s3):
    proxy, root = counted_s3
    saved = {f"t{i}": torch.arange(100, dtype=torch.float32) + i for i in range(10)}
    bcp.save(f"{root}/step_1", saved)
    proxy.reset_counts()
    state = {f"t{i}": torch.zeros(100) for i in range(10)}
    bcp.load(f"{root}/step_1", state)
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    data = [line for line in proxy.lines if ".safetensors" in line]
    # Was 43 (a HEAD and a GET per tensor, 22 + 21); the file is read as one span now.
    assert len(data) <= 8, data


@pytest.mark.parametrize("part_bytes,threads", [(7, 3), (1 << 20, 1), (5, 8)])
def test_s3_a_vectored_read_fills_every_buffer_as_one_read_per_buffer_would(counted_s3, part_bytes, threads):
    proxy, root = counted_s3
    storage, path = open_storage(root)
    blob = bytes(range(256)) * 3 + b"tail"  # 772 bytes
    storage.write_bytes(f"{path}/blob", blob)
    backend = S3Storage(transfer=TransferSettings(part_bytes=part_bytes, threads=threads))
    for offset, sizes in [(0, [10, 0, 300, 1]), (17, [100, 200, 3]), (700, [50, 50]), (772, [4, 4]),
                          (760, [12, 0]), (900, [1, 2])]:
        mine = [bytearray(n) for n in sizes]
        ref = [bytearray(n) for n in sizes]
        proxy.reset_counts()
        got = backend.read_into_many(f"{path}/blob", offset, [memoryview(b) for b in mine])
        assert proxy.requests["HEAD"] <= 1, (offset, sizes, proxy.lines)
        want = Storage.read_into_many(backend, f"{path}/blob", offset, [memoryview(b) for b in ref])
        assert got == want == max(0, min(sum(sizes), len(blob) - offset)), (offset, sizes)
        assert mine == ref, (offset, sizes)
    # A single read past the end, split into parts: short, as a read of a truncated file must
    # be (was "Cannot read past end of file", retried as a transient failure).
    assert backend.read_into(f"{path}/blob", 750, memoryview(bytearray(50))) == 22
    with pytest.raises(FileNotFoundError):
        backend.read_into_many(f"{path}/missing", 0, [memoryview(bytearray(4)), memoryview(bytearray(4))])
