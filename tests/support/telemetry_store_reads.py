"""Reads the tests make of the telemetry store that no product code needs: how many rows were
stored against how many distinct events (duplicates merged away), and the quarantine table."""

from __future__ import annotations

from typing import Any

from telemetry.store.schema import EVENTS, QUARANTINE

_FILTERS = "({job:String} = '' OR job = {job:String}) AND ({run:String} = '' OR run = {run:String})"


def event_counts(client: Any, *, job: str = "", run: str = "") -> dict[str, int]:
    """Rows as stored, distinct event ids, and rows after FINAL (equal once duplicates merge)."""
    sql = f"""
    SELECT count() AS stored, uniqExact(event_id) AS distinct_ids,
           (SELECT count() FROM {EVENTS} FINAL WHERE {_FILTERS}) AS final_rows
    FROM {EVENTS} WHERE {_FILTERS}
    """
    row = next(iter(client.query(sql, parameters={"job": job, "run": run}).named_results()))
    return {key: int(value) for key, value in row.items()}


def quarantined(client: Any, *, limit: int = 500) -> list[dict[str, Any]]:
    """Records the ingester could not store, newest first."""
    sql = f"""
    SELECT quarantined_at, source, position, reason, record, record_bytes FROM {QUARANTINE}
    ORDER BY quarantined_at DESC
    LIMIT {{limit:UInt32}}
    """
    return list(client.query(sql, parameters={"limit": limit}).named_results())
