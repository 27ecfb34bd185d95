"""Alert webhooks through the outbox, against a real HTTP receiver on 127.0.0.1 that fails at first."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from telemetry.alerts import SlowRank, evaluate
from telemetry.alerts.engine import RuleSet, load_rules
from telemetry.alerts.outbox import states
from telemetry.store import connect, ensure_schema, insert_events
from tests.support.dist import free_port


class Receiver:
    """A webhook receiver that answers 503 to the first ``fail_first`` posts, then 200, and
    deduplicates on the Idempotency-Key header the way a careful receiver would."""

    def __init__(self, port: int, fail_first: int = 0) -> None:
        self.fail_first = fail_first
        self.posts: list[tuple[str, dict[str, Any]]] = []  # (Idempotency-Key, body) of every POST
        self.accepted: dict[str, dict[str, Any]] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.posts.append((self.headers.get("Idempotency-Key", ""), body))
                ok = len(receiver.posts) > receiver.fail_first
                if ok:
                    receiver.accepted.setdefault(self.headers["Idempotency-Key"], body)
                self.send_response(200 if ok else 503)
                self.end_headers()

            def log_message(self, *args):
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def store(chdb_dsn: str) -> Iterator[Any]:
    client = connect(chdb_dsn)
    ensure_schema(client)
    yield client
    client.close()


def _slow_rank_events(slow: int, job: str = "j") -> list[dict[str, Any]]:
    return [{"event_id": uuid.uuid4().hex, "name": "save.write", "ts": time.time(),
             "duration_s": 4.0 if rank == slow else 0.2, "outcome": "ok", "job": job, "run": "r",
             "rank": rank, "step": 1, "checkpoint": f"/c/{job}", "checkpoint_op": "save", "attrs": {}}
            for rank in range(4)]


def test_a_failed_post_is_retried_with_backoff_until_accepted_and_seen_once(store):
    port = free_port()
    ruleset = RuleSet(SlowRank(), webhook=f"http://127.0.0.1:{port}/hook", webhook_timeout_s=2.0,
                      webhook_backoff_s=30.0)
    insert_events(store, _slow_rank_events(slow=3))
    t0 = time.time()
    # Nothing listens yet: the first post fails, the alert is stored and stays queued.
    [alert] = evaluate(store, ruleset, now=t0)
    assert states(store)[alert.alert_id]["state"] == "pending"
    receiver = Receiver(port, fail_first=1)  # then up, but it answers 503 once
    try:
        assert evaluate(store, ruleset, now=t0 + 10) == []
        assert receiver.posts == [], "a retry waits for its backoff (30 s)"
        evaluate(store, ruleset, now=t0 + 31)
        assert len(receiver.posts) == 1 and not receiver.accepted  # the 503
        evaluate(store, ruleset, now=t0 + 31 + 59)
        assert len(receiver.posts) == 1, "the second wait doubles (60 s)"
        evaluate(store, ruleset, now=t0 + 31 + 61)
        assert list(receiver.accepted) == [alert.alert_id]
        for later in (200, 5000, 100000):
            evaluate(store, ruleset, now=t0 + later)
        assert len(receiver.posts) == 2, "an accepted alert is never posted again"
        assert all(key == body["alert_id"] == alert.alert_id for key, body in receiver.posts)
        assert receiver.accepted[alert.alert_id]["alerts"][0]["rank"] == 3
        assert states(store)[alert.alert_id] == {"state": "delivered", "attempts": 3, "last_error": ""}
    finally:
        receiver.close()


def test_retries_are_bounded(store, caplog):
    receiver = Receiver(free_port(), fail_first=10**6)
    try:
        ruleset = RuleSet(SlowRank(), webhook=receiver.url, webhook_max_attempts=3, webhook_backoff_s=1.0)
        insert_events(store, _slow_rank_events(slow=1))
        t0 = time.time()
        [alert] = evaluate(store, ruleset, now=t0)
        for step in range(1, 20):
            evaluate(store, ruleset, now=t0 + step * 100)
        assert len(receiver.posts) == 3
        state = states(store)[alert.alert_id]
        assert state["state"] == "abandoned" and state["last_error"] == "HTTP 503"
        assert any("giving up" in r.getMessage() for r in caplog.records)
    finally:
        receiver.close()


def test_rules_file_sets_retry_policy(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("webhook: http://127.0.0.1:1/h\nwebhook_max_attempts: 4\nwebhook_backoff_s: 5\n"
                    "rules:\n  - {type: slow_rank}\n")
    delivery = load_rules(path).delivery
    assert (delivery.max_attempts, delivery.backoff_s) == (4, 5.0)
    path.write_text("webhook_max_attempts: 0\nrules: []\n")
    with pytest.raises(ValueError, match="webhook_max_attempts"):
        load_rules(path)
