"""Review of the S3 client's behaviour (pyarrow's S3FileSystem under the storage's retries).
Every test here failed before its fix."""

from __future__ import annotations

import socket
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import InvalidStorageSettingError, PermanentStorageError, TransientStorageError
from bytecheckpoint.storage import open_storage
from tests.support.servers import s3_root


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_s3_an_unreachable_endpoint_fails_a_save_within_seconds_and_names_it(monkeypatch):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("BCP_S3_ENDPOINT", endpoint)
    started = time.monotonic()
    # Was ~87 s: the AWS SDK's 6 attempts (backoff up to 20 s) inside each of the storage's 6.
    with pytest.raises(TransientStorageError, match=f"S3 endpoint {endpoint} failed.*check BCP_S3_ENDPOINT"):
        bcp.save("s3://bcp-test/unreachable/step_1", {"w": torch.zeros(4)})
    assert time.monotonic() - started < 20
    storage, path = open_storage("s3://bcp-test/unreachable")
    started = time.monotonic()
    with pytest.raises(TransientStorageError, match="after 6 attempts"):
        storage.size(f"{path}/x")  # every whole operation: one HTTP request per retry
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("endpoint", ["http://admin:hunter2@127.0.0.1:9000", "ftp://127.0.0.1:9000",
                                      "http://127.0.0.1:9000/minio"])
def test_s3_an_endpoint_the_sdk_would_misread_is_refused_at_once_without_its_password(monkeypatch, endpoint):
    # Was, for the first: a host named "admin" to the SDK, retried, "could not resolve host".
    monkeypatch.setenv("BCP_S3_ENDPOINT", endpoint)
    started = time.monotonic()
    with pytest.raises(InvalidStorageSettingError, match="S3 endpoint .* is not valid") as caught:
        open_storage("s3://bcp-test/x")
    assert "hunter2" not in str(caught.value) and time.monotonic() - started < 5


def test_s3_a_load_from_a_bucket_that_does_not_exist_says_so():
    state = {"w": torch.zeros(4)}
    for url in ("s3://no-such-bucket-bcp/run", "s3://no-such-bucket-bcp/run/step_1"):
        with pytest.raises(PermanentStorageError, match="bucket does not exist"):
            bcp.load(url, state)  # was NotACheckpointError "no such checkpoint"
    storage, path = open_storage(s3_root("bucket"))
    assert not storage.exists(f"{path}/missing") and not storage.is_dir(f"{path}/missing")
