"""A throttling S3 (503 SlowDown) is waited for longer than a dropped connection: each whole
operation is one HTTP attempt per storage retry, so the storage's backoff is all the patience
there is. Through a proxy that answers SlowDown in front of the test S3 server."""

from __future__ import annotations

import pytest

from bytecheckpoint.errors import TransientStorageError
from bytecheckpoint.storage import open_storage, retry
from bytecheckpoint.storage.config import RetrySettings
from bytecheckpoint.storage.s3 import S3Storage
from tests.support.s3_busy_proxy import proxied_s3_root


@pytest.fixture
def busy_s3(monkeypatch):
    with proxied_s3_root(monkeypatch, "busy") as found:
        yield found


def test_a_slow_down_answer_is_named_busy_and_retried_until_it_clears(busy_s3):
    proxy, root = busy_s3
    storage, path = open_storage(root)
    storage.write_bytes(f"{path}/blob", b"x" * 1000)
    proxy.busy["HEAD"] = 1
    with pytest.raises(TransientStorageError) as caught:
        S3Storage().size(f"{path}/blob")  # the backend alone: one attempt, no retries
    assert caught.value.server_busy
    proxy.busy["GET"] = 2
    proxy.busy["HEAD"] = 1
    assert bytes(storage.read(f"{path}/blob")) == b"x" * 1000  # through the storage's retries
    assert proxy.answered_busy["GET"] == 2 and proxy.answered_busy["HEAD"] == 2


def test_a_dropped_connection_is_not_taken_for_a_busy_server():
    assert not TransientStorageError("connection reset").server_busy


def test_busy_answers_back_off_longer_than_other_transient_errors():
    policy = RetrySettings(attempts=6, base_s=0.05, max_s=2.0, deadline_s=120)
    busy = TransientStorageError("SlowDown")
    busy.server_busy = True
    plain = TransientStorageError("reset")
    for attempt, busy_cap, plain_cap in [(1, 0.5, 0.05), (3, 2.0, 0.2), (5, 8.0, 0.8), (7, 20.0, 2.0)]:
        waits = [retry.backoff_s(policy, attempt, busy) for _ in range(400)]
        assert max(waits) <= busy_cap and max(waits) > busy_cap * 0.8
        waits = [retry.backoff_s(policy, attempt, plain) for _ in range(400)]
        assert max(waits) <= plain_cap and max(waits) > plain_cap * 0.8
