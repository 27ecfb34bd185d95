"""The S3 backend against moto_server (a real S3 API on 127.0.0.1) through pyarrow.fs."""

from __future__ import annotations

import os
import time

import pytest

from bytecheckpoint.errors import PermanentStorageError
from bytecheckpoint.storage import CommitMode, open_storage
from bytecheckpoint.storage.config import TransferSettings
from bytecheckpoint.storage.s3 import MIN_PART_BYTES, S3Storage
from tests.support.servers import s3_root


def test_s3_roundtrip_multipart_and_ranged_parallel_reads():
    storage, path = open_storage(s3_root("rt"))
    assert storage.commit_mode is CommitMode.MARKER
    backend = S3Storage(transfer=TransferSettings(part_bytes=MIN_PART_BYTES, threads=3))
    data = os.urandom(3 * MIN_PART_BYTES + 12345)  # 4 parts, the last one short
    writer = backend.open_writer(f"{path}/big")
    for start in range(0, len(data), 1 << 20):
        writer.write(memoryview(data)[start : start + (1 << 20)])
    assert writer.commit() == len(data)
    assert storage.size(f"{path}/big") == len(data)
    buf = bytearray(len(data) - 100)
    assert backend.read_into(f"{path}/big", 50, memoryview(buf)) == len(buf)
    assert buf == data[50:-50]
    tail = bytearray(1000)
    assert backend.read_into(f"{path}/big", len(data) - 10, memoryview(tail)) == 10
    assert storage.list_dir(path) == ["big"] and storage.is_dir(path)
    storage.delete(path)
    assert not storage.exists(f"{path}/big")


def test_s3_small_file_marker_semantics():
    storage, path = open_storage(s3_root("small"))
    storage.write_bytes(f"{path}/a/x", b"hello")
    assert bytes(storage.read(f"{path}/a/x")) == b"hello"
    with pytest.raises(FileNotFoundError):
        storage.size(f"{path}/a/missing")
    assert storage.list_dir(f"{path}/nothing") == []


def test_s3_missing_bucket_fails_at_once_with_advice():
    storage, _ = open_storage("s3://no-such-bucket-here/x")
    t = time.monotonic()
    with pytest.raises(PermanentStorageError, match="bucket does not exist: create it"):
        storage.write_bytes("no-such-bucket-here/x/file", b"data")
    assert time.monotonic() - t < 5  # no retries for a permanent error


def test_s3_an_aborted_multipart_file_leaves_no_truncated_object_behind():
    storage, path = open_storage(s3_root("abort"))
    backend = S3Storage(transfer=TransferSettings(part_bytes=MIN_PART_BYTES, threads=2))
    writer = backend.open_writer(f"{path}/model-00000.safetensors")
    writer.write(os.urandom(MIN_PART_BYTES + 100))  # one part sent, the rest buffered
    writer.abort()
    # Was there, 5 MiB of it: pyarrow completes a multipart upload it is asked to drop.
    assert not storage.exists(f"{path}/model-00000.safetensors")
