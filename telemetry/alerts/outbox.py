"""Webhook delivery through an outbox table: an alert is posted until the receiver accepts it.

A new alert is put in ``alert_outbox`` before it is stored as known, so no alert can be
known but never posted. Every evaluation run posts the alerts that are due, one POST each,
with the alert id in the body and in an ``Idempotency-Key`` header: a receiver that saw the
key already can drop a repeat (a crash between its 2xx and our record of it), so it sees each
alert once. A failed post (no answer, or not 2xx) is tried again on a later run after an
exponentially growing wait, at most ``max_attempts`` times; then the alert is abandoned and
that is logged as an error. When the receiver does not answer at all, the run stops posting
(the other due alerts keep their attempts for the next run).
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from telemetry.alerts.base import Alert
from telemetry.store.schema import ALERT_OUTBOX

log = logging.getLogger("telemetry.alerts")

DEFAULT_MAX_ATTEMPTS = 8
DEFAULT_BACKOFF_S = 30.0
MAX_BACKOFF_S = 3600.0
# Posts per run at most, so a long backlog cannot stall the evaluation loop.
POSTS_PER_RUN = 100
COLUMNS = ("alert_id", "body", "attempts", "state", "next_try", "last_error", "updated_at")
PENDING, DELIVERED, ABANDONED = "pending", "delivered", "abandoned"


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """How a webhook is posted to: where, how long to wait, how often to retry."""

    url: str
    timeout_s: float = 5.0
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backoff_s: float = DEFAULT_BACKOFF_S


def _time(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def enqueue(client: Any, alerts: Sequence[Alert], now: float) -> None:
    """Put new alerts in the outbox (attempt 0, due now)."""
    rows = []
    for alert in alerts:
        body = json.dumps({"alert_id": alert.alert_id, "alerts": [alert.to_row(now)]}, default=str)
        rows.append([alert.alert_id, body, 0, PENDING, _time(now), "", _time(now)])
    if rows:
        client.insert(ALERT_OUTBOX, rows, column_names=list(COLUMNS))


def post(url: str, body: str, key: str, timeout_s: float) -> str | None:
    """POST ``body``; None when the receiver accepted it (2xx), else what went wrong."""
    request = urllib.request.Request(url, data=body.encode(), method="POST", headers={
        "Content-Type": "application/json", "Idempotency-Key": key})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - configured URL
            return None if 200 <= response.status < 300 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except Exception as exc:  # noqa: BLE001 - unreachable, timeout, bad URL: retried later
        return f"{type(exc).__name__}: {exc}"


def deliver(client: Any, delivery: Delivery, now: float) -> dict[str, int]:
    """Post every due alert once; record each outcome. Returns counts by outcome."""
    due = client.query(
        f"SELECT alert_id, body, attempts FROM {ALERT_OUTBOX} FINAL "
        "WHERE state = {pending:String} AND next_try <= {now:DateTime64(3)} "
        "ORDER BY next_try LIMIT {limit:UInt32}",
        parameters={"pending": PENDING, "now": _time(now), "limit": POSTS_PER_RUN}).result_rows
    counts = {DELIVERED: 0, PENDING: 0, ABANDONED: 0}
    for alert_id, body, attempts in due:
        error = post(delivery.url, body, alert_id, delivery.timeout_s)
        attempts += 1
        if error is None:
            state, next_try = DELIVERED, now
        elif attempts >= delivery.max_attempts:
            state, next_try = ABANDONED, now
            log.error("alert webhook %s: giving up on alert %s after %d attempts (last: %s); it stays in "
                      "the alerts table", delivery.url, alert_id, attempts, error)
        else:
            state = PENDING
            next_try = now + min(delivery.backoff_s * 2 ** (attempts - 1), MAX_BACKOFF_S)
            log.warning("alert webhook %s failed for alert %s (%s); attempt %d of %d, next in %.0f s",
                        delivery.url, alert_id, error, attempts, delivery.max_attempts, next_try - now)
        row = [alert_id, body, attempts, state, _time(next_try), error or "", _time(now)]
        client.insert(ALERT_OUTBOX, [row], column_names=list(COLUMNS))
        counts[state] += 1
        if error is not None and not error.startswith("HTTP "):
            break  # no answer at all: the rest wait for the next run instead of each timing out
    return counts


def states(client: Any) -> dict[str, dict[str, Any]]:
    """alert_id -> {state, attempts, last_error} of every alert in the outbox."""
    rows = client.query(f"SELECT alert_id, state, attempts, last_error FROM {ALERT_OUTBOX} FINAL").result_rows
    return {r[0]: {"state": r[1], "attempts": r[2], "last_error": r[3]} for r in rows}
