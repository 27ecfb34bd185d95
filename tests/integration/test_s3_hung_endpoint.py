"""An S3 endpoint that accepts connections and never answers (a hung server) fails each attempt
after the configured request timeout, with an error naming the endpoint and the seconds: it
cost 60 s an attempt, and the setting could only be given in the config file."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import InvalidStorageSettingError, StorageTimeoutError
from bytecheckpoint.storage import open_storage
from bytecheckpoint.storage.config import S3Settings, settings


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A real TCP server on 127.0.0.1 that accepts every connection and never sends a byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)  # kept open, never answered

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    for conn in held:
        conn.close()


def test_s3_a_hung_endpoint_fails_each_attempt_after_the_request_timeout(monkeypatch, silent_endpoint):
    monkeypatch.setenv("BCP_S3_ENDPOINT", silent_endpoint)
    monkeypatch.setenv("BCP_S3_REQUEST_TIMEOUT_S", "1")
    monkeypatch.setenv("BCP_STORAGE_RETRY_ATTEMPTS", "2")
    storage, path = open_storage("s3://bcp-test/hung")
    started = time.monotonic()
    with pytest.raises(StorageTimeoutError, match=f"S3 endpoint {silent_endpoint} accepted the connection "
                       r"but did not answer within 1 s \(BCP_S3_REQUEST_TIMEOUT_S") as caught:
        storage.size(f"{path}/x")
    assert "after 2 attempts" in str(caught.value)
    assert time.monotonic() - started < 6  # two attempts of 1 s (was 60 s each)
    started = time.monotonic()
    with pytest.raises(StorageTimeoutError, match="did not answer within 1 s"):
        bcp.save("s3://bcp-test/hung/step_1", {"w": torch.zeros(4)})
    assert time.monotonic() - started < 15


def test_s3_the_request_timeout_comes_from_the_config_file_and_the_environment_wins(
        monkeypatch, tmp_path, silent_endpoint):
    conf = tmp_path / "storage.toml"
    conf.write_text(f'[s3]\nendpoint = "{silent_endpoint}"\nrequest_timeout_s = 2\nconnect_timeout_s = 3\n'
                    "[retry]\nattempts = 1\n")
    for name in ("BCP_S3_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BCP_STORAGE_CONFIG", str(conf))
    assert (settings().s3.request_timeout_s, settings().s3.connect_timeout_s) == (2, 3)
    storage, path = open_storage("s3://bcp-test/hung")
    started = time.monotonic()
    with pytest.raises(StorageTimeoutError, match="within 2 s"):
        storage.size(f"{path}/x")
    assert 1.5 < time.monotonic() - started < 5
    monkeypatch.setenv("BCP_S3_REQUEST_TIMEOUT_S", "1")
    monkeypatch.setenv("BCP_S3_CONNECT_TIMEOUT_S", "0.5")
    assert (settings().s3.request_timeout_s, settings().s3.connect_timeout_s) == (1, 0.5)


def test_s3_timeouts_default_to_what_a_training_job_wants_and_bad_values_are_named(monkeypatch):
    for name in ("BCP_S3_REQUEST_TIMEOUT_S", "BCP_S3_CONNECT_TIMEOUT_S", "BCP_STORAGE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert (settings().s3.connect_timeout_s, settings().s3.request_timeout_s) == (
        S3Settings.connect_timeout_s, S3Settings.request_timeout_s) == (5.0, 20.0)
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("BCP_S3_REQUEST_TIMEOUT_S", bad)
        with pytest.raises(InvalidStorageSettingError, match="BCP_S3_REQUEST_TIMEOUT_S"):
            settings()
