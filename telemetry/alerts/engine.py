"""Evaluate alert rules against the store: read a window, run the rules, keep only new alerts,
write them to the alerts table, log them, and post them to a webhook if one is configured
(through an outbox, so a failed post is retried on later runs: ``telemetry.alerts.outbox``)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from telemetry.alerts.base import Alert, AlertConfigError, AllRule, AnyRule, Context, Rule, Window
from telemetry.alerts.failures import FailedOps
from telemetry.alerts.outbox import DEFAULT_BACKOFF_S, DEFAULT_MAX_ATTEMPTS, Delivery, deliver, enqueue
from telemetry.alerts.slow_rank import SlowRank
from telemetry.alerts.throughput import LowThroughput
from telemetry.alerts.uncommitted import Uncommitted
from telemetry.alerts.unfinished import UnfinishedRanks
from telemetry.store import insert_alerts, queries

log = logging.getLogger("telemetry.alerts")

RULE_TYPES: dict[str, type] = {
    "slow_rank": SlowRank,
    "low_throughput": LowThroughput,
    "failed_ops": FailedOps,
    "uncommitted": Uncommitted,
    "unfinished_ranks": UnfinishedRanks,
}
DEFAULT_CONFIG: dict[str, Any] = {
    "window_s": 86400,
    "rules": [{"type": name} for name in RULE_TYPES],
}


@dataclass(frozen=True)
class RuleSet:
    rule: Rule
    window_s: float = 86400.0
    webhook: str | None = None
    webhook_timeout_s: float = 5.0
    webhook_max_attempts: int = DEFAULT_MAX_ATTEMPTS
    webhook_backoff_s: float = DEFAULT_BACKOFF_S

    @property
    def delivery(self) -> Delivery | None:
        if not self.webhook:
            return None
        return Delivery(url=self.webhook, timeout_s=self.webhook_timeout_s,
                        max_attempts=self.webhook_max_attempts, backoff_s=self.webhook_backoff_s)


def _number(where: str, value: Any, *, whole: bool = False, positive: bool = False) -> float:
    """A finite number >= 0 (> 0 when ``positive``); a quoted "3.5" or a NaN would otherwise
    fail every evaluation, or silently never alert."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0) or (whole and not float(value).is_integer()):
        kind = "a whole number" if whole else "a number"
        bound = "> 0" if positive else ">= 0"
        raise AlertConfigError(f"{where} must be {kind} {bound}, got {value!r}")
    return value


def _setting(where: str, default: Any, value: Any) -> Any:
    """``value`` checked against the type of the setting's default."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise AlertConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, (int, float)):
        return type(default)(_number(where, value, whole=isinstance(default, int)))
    if isinstance(default, str):
        if not isinstance(value, str):
            raise AlertConfigError(f"{where} must be a string, got {value!r}")
        return value
    if isinstance(default, tuple):
        items = [value] if isinstance(value, str) else value  # one name, not its characters
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
            raise AlertConfigError(f"{where} must be a list of strings, got {value!r}")
        return tuple(items)  # hashable, so the rule dataclasses stay frozen
    return value


def build_rule(spec: dict[str, Any]) -> Rule:
    """``{"type": "slow_rank", "z": 3.0}`` -> SlowRank(z=3.0); "any"/"all" take ``rules: [...]``."""
    kinds = ", ".join([*RULE_TYPES, "any", "all"])
    if not isinstance(spec, dict) or "type" not in spec:
        raise AlertConfigError(f"alert rule {spec!r} needs a 'type' (one of {kinds})")
    params = {k: v for k, v in spec.items() if k != "type"}
    kind = spec["type"]
    if kind in ("any", "all"):
        extra = sorted(set(params) - {"rules"})
        if extra:
            raise AlertConfigError(f"alert rule {kind}: unknown setting(s) {extra}; valid: ['rules']")
        members = tuple(build_rule(s) for s in _rule_list(f"alert rule {kind}", params.get("rules", [])))
        return AnyRule(members) if kind == "any" else AllRule(members)
    cls = RULE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise AlertConfigError(f"unknown alert rule type {kind!r}; known: {kinds}")
    defaults = {f.name: f.default for f in fields(cls)}
    unknown = set(params) - set(defaults)
    if unknown:
        raise AlertConfigError(f"alert rule {kind}: unknown setting(s) {sorted(unknown)}; "
                               f"valid: {sorted(defaults)}")
    return cls(**{k: _setting(f"alert rule {kind}: {k}", defaults[k], v) for k, v in params.items()})


def _rule_list(where: str, rules: Any) -> list[Any]:
    if not isinstance(rules, list):
        raise AlertConfigError(f"{where}: 'rules' must be a list of rules, got {rules!r}")
    return rules


_CONFIG_KEYS = ("window_s", "webhook", "webhook_timeout_s", "webhook_max_attempts", "webhook_backoff_s",
                "rules")


def rules_from_config(config: dict[str, Any]) -> RuleSet:
    unknown = set(config) - set(_CONFIG_KEYS)
    if unknown:
        raise AlertConfigError(f"alert config: unknown key(s) {sorted(unknown)}; "
                               f"valid: {', '.join(_CONFIG_KEYS)}")
    rule = AnyRule(tuple(build_rule(spec) for spec in _rule_list("alert config", config.get("rules", []))))
    attempts = config.get("webhook_max_attempts", DEFAULT_MAX_ATTEMPTS)
    if _number("alert config: webhook_max_attempts", attempts, whole=True) < 1:
        raise AlertConfigError("alert config: webhook_max_attempts must be at least 1")
    webhook = config.get("webhook") or None
    if webhook is not None and not isinstance(webhook, str):
        raise AlertConfigError(f"alert config: webhook must be a URL, got {webhook!r}")
    window_s = _number("alert config: window_s", config.get("window_s", 86400), positive=True)
    timeout_s = _number("alert config: webhook_timeout_s", config.get("webhook_timeout_s", 5.0),
                        positive=True)
    backoff_s = _number("alert config: webhook_backoff_s", config.get("webhook_backoff_s", DEFAULT_BACKOFF_S))
    return RuleSet(rule, float(window_s), webhook, float(timeout_s), int(attempts), float(backoff_s))


def load_rules(path: str | Path | None) -> RuleSet:
    """Rules from a YAML (or JSON) file; None gives every rule with its defaults."""
    if path is None:
        return rules_from_config(DEFAULT_CONFIG)
    import yaml

    text = Path(path).read_text()
    try:
        config = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise AlertConfigError(f"alert rules file {path} is not valid YAML: {exc}") from exc
    if not isinstance(config, dict):
        raise AlertConfigError(f"alert rules file {path} must hold a mapping with a 'rules' list")
    return rules_from_config(config)


def evaluate(client: Any, ruleset: RuleSet, *, now: float | None = None, job: str = "") -> list[Alert]:
    """Run the rules over the last ``window_s`` seconds; store, log and post the new alerts, and
    post again the earlier ones whose webhook delivery is due for a retry."""
    now = time.time() if now is None else now
    since = now - ruleset.window_s
    rows = queries.rank_phases(client, datetime.fromtimestamp(since, tz=timezone.utc), job=job)
    found = ruleset.rule.evaluate(Window(rows, since), context=Context(now=now))
    unique: dict[str, Alert] = {}
    for alert in found:
        unique.setdefault(alert.alert_id, alert)
    known = queries.alert_ids(client, list(unique))
    new = [alert for alert_id, alert in unique.items() if alert_id not in known]
    delivery = ruleset.delivery
    if new:
        if delivery is not None:
            # Into the outbox before the alerts table: an alert known as seen is always queued.
            enqueue(client, new, now)
        insert_alerts(client, [alert.to_row(now) for alert in new])
        for alert in new:
            log.warning("alert %s [%s]: %s", alert.rule, alert.severity, alert.message)
    if delivery is not None:
        deliver(client, delivery, now)
    return new


class Scheduler:
    """Calls ``evaluate`` at most every ``every_s`` seconds (hooked into the ingester's idle loop)."""

    def __init__(self, ruleset: RuleSet, every_s: float = 60.0) -> None:
        self.ruleset = ruleset
        self.every_s = every_s
        self._last = float("-inf")

    def maybe_run(self, client: Any) -> list[Alert]:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return []
        self._last = now
        try:
            return evaluate(client, self.ruleset)
        except Exception as exc:  # noqa: BLE001 - retried on the next tick
            log.warning("alert evaluation failed (%s); retrying in %.0f s", exc, self.every_s)
            return []
