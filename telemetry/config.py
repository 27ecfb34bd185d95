"""Runtime configuration: environment defaults plus configure() overrides.

Settings are read when the sink starts (the first event) and on every ``configure()``, not
at import, so a program may set these variables after importing the library.

| variable | meaning |
| --- | --- |
| BCP_TELEMETRY | on (default) / off |
| BCP_TELEMETRY_DIR | spool directory (with Kafka: its write-ahead spool, in kafka-pending/) |
| BCP_TELEMETRY_SINK | "spool" (default) or "kafka" (the default when BCP_TELEMETRY_KAFKA is set) |
| BCP_TELEMETRY_KAFKA | Kafka bootstrap servers, "host:port[,host:port]" |
| BCP_TELEMETRY_TOPIC | Kafka topic (default "bcp-telemetry") |
| BCP_TELEMETRY_SPOOL_MAX_BYTES | size of one spool segment before rotation |
| BCP_TELEMETRY_SPOOL_LIMIT_BYTES | spool bytes not yet ingested / acknowledged; past it the oldest drop |
| BCP_TELEMETRY_FSYNC | interval (default: fsync in small groups, in the background) / always / never |
| BCP_TELEMETRY_QUEUE | in-memory queue length (sinks that are not a spool) |
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from telemetry import emitter
from telemetry.sinks.base import Sink
from telemetry.sinks.kafka import DEFAULT_SPOOL_LIMIT, DEFAULT_TOPIC, KafkaSink
from telemetry.sinks.segments import DEFAULT_FSYNC, FSYNC_POLICIES
from telemetry.sinks.spool import DEFAULT_MAX_BYTES, SpoolSink

log = logging.getLogger(__name__)
_OFF_VALUES = frozenset({"off", "0", "false", "no", "disabled"})


@dataclass
class Settings:
    enabled: bool
    spool_dir: Path
    spool_max_bytes: int
    queue_size: int
    sink: str = "spool"
    kafka: str = ""
    topic: str = DEFAULT_TOPIC
    spool_limit_bytes: int = DEFAULT_SPOOL_LIMIT
    fsync: str = DEFAULT_FSYNC


_warned: set[tuple[str, str]] = set()


def _ignored(name: str, raw: str, used: object) -> None:
    """A bad value must not take the training job down, nor pass unnoticed: warn once, by name."""
    if (name, raw) not in _warned:
        _warned.add((name, raw))
        log.warning("telemetry: %s=%r is not valid; using %r instead", name, raw, used)


def _env_positive_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        _ignored(name, raw, default)
        return default
    return value


SINKS = ("spool", "kafka")
# What a configure() call pinned; the environment supplies the rest each time it is read.
_overrides: dict[str, Any] = {}


def _settings_from_env() -> Settings:
    spool_dir = os.environ.get("BCP_TELEMETRY_DIR", "").strip()
    kafka = os.environ.get("BCP_TELEMETRY_KAFKA", "").strip()
    sink = os.environ.get("BCP_TELEMETRY_SINK", "").strip().lower() or ("kafka" if kafka else "spool")
    if sink not in SINKS or (sink == "kafka" and not kafka):
        # A bad setting must not take the training job down: keep events locally.
        _ignored("BCP_TELEMETRY_SINK", sink + ("" if sink != "kafka" else " (no BCP_TELEMETRY_KAFKA)"),
                 "spool")
        sink = "spool"
    fsync = os.environ.get("BCP_TELEMETRY_FSYNC", "").strip().lower() or DEFAULT_FSYNC
    if fsync not in FSYNC_POLICIES:
        _ignored("BCP_TELEMETRY_FSYNC", fsync, DEFAULT_FSYNC)
    return Settings(
        sink=sink,
        kafka=kafka,
        topic=os.environ.get("BCP_TELEMETRY_TOPIC", "").strip() or DEFAULT_TOPIC,
        spool_limit_bytes=_env_positive_int("BCP_TELEMETRY_SPOOL_LIMIT_BYTES", DEFAULT_SPOOL_LIMIT),
        enabled=os.environ.get("BCP_TELEMETRY", "on").strip().lower() not in _OFF_VALUES,
        # Made absolute when the sink starts, so a later chdir() does not scatter spool files.
        spool_dir=Path(spool_dir or Path.cwd() / ".bytecheckpoint" / "telemetry").absolute(),
        spool_max_bytes=_env_positive_int("BCP_TELEMETRY_SPOOL_MAX_BYTES", DEFAULT_MAX_BYTES),
        queue_size=_env_positive_int("BCP_TELEMETRY_QUEUE", emitter.DEFAULT_QUEUE_SIZE),
        fsync=fsync if fsync in FSYNC_POLICIES else DEFAULT_FSYNC,
    )


# Mutated in place (never rebound) so modules holding a reference see every change.
settings = _settings_from_env()


def _refresh() -> Settings:
    """Re-read the environment under this process's configure() overrides."""
    fresh = _settings_from_env()
    fresh.__dict__.update(_overrides)
    if _overrides.get("kafka") and "sink" not in _overrides:
        fresh.sink = "kafka"
    settings.__dict__.update(fresh.__dict__)
    return settings


def build_sink(s: Settings) -> Sink:
    """The sink ``s`` describes: the spool, or Kafka through its write-ahead spool."""
    if s.sink == "kafka":
        return KafkaSink(s.kafka, s.topic, s.spool_dir, spool_limit_bytes=s.spool_limit_bytes,
                         spool_file_bytes=s.spool_max_bytes, fsync=s.fsync)
    return SpoolSink(s.spool_dir, s.spool_max_bytes, limit_bytes=s.spool_limit_bytes, fsync=s.fsync)


_SINK_KEYS = ("sink", "spool_dir", "spool_max_bytes", "kafka", "topic", "spool_limit_bytes", "fsync")
# The settings the current sink was built from; None for a Sink instance passed to configure().
_built_from: list[dict[str, Any] | None] = [None]


def _sink_settings(s: Settings) -> dict[str, Any]:
    return {key: getattr(s, key) for key in _SINK_KEYS}


def _build(s: Settings) -> Sink:
    _built_from[0] = _sink_settings(s)
    return build_sink(s)


def _start_sink() -> Sink | None:
    """The emitter's factory: runs at the first event, so it sees the program's settings."""
    s = _refresh()
    if not s.enabled:
        return None
    emitter.EMITTER.set_queue_size(s.queue_size)
    return _build(s)


def configure(
    sink: Sink | str | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    enabled: bool | None = None,
    queue_size: int | None = None,
    spool_max_bytes: int | None = None,
    *,
    kafka: str | None = None,
    topic: str | None = None,
    spool_limit_bytes: int | None = None,
    fsync: str | None = None,
) -> None:
    """Change telemetry settings at runtime; arguments left as None keep their value.

    ``sink`` is a Sink instance, or "spool" / "kafka". ``kafka`` (bootstrap servers) implies
    the Kafka sink; ``spool_dir`` is where the spool, or Kafka's write-ahead spool, goes.
    ``fsync`` is "interval", "always" or "never". Settings not given are read from the
    environment again now. Events already queued are flushed to the old sink first.
    """
    given = {"spool_dir": spool_dir, "spool_max_bytes": spool_max_bytes, "kafka": kafka, "topic": topic,
             "spool_limit_bytes": spool_limit_bytes, "fsync": fsync}
    if isinstance(sink, Sink):
        if any(v is not None for v in given.values()):
            raise ValueError("pass either a Sink instance or sink settings, not both")
    elif sink is not None and sink not in SINKS:
        raise ValueError(f"unknown telemetry sink {sink!r}; use one of {', '.join(SINKS)} or a Sink")
    for name, value in (("spool_max_bytes", spool_max_bytes), ("spool_limit_bytes", spool_limit_bytes),
                        ("queue_size", queue_size)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive")
    if fsync is not None and fsync not in FSYNC_POLICIES:
        raise ValueError(f"unknown fsync policy {fsync!r}; use one of {', '.join(FSYNC_POLICIES)}")
    if isinstance(sink, str):
        given["sink"] = sink
    elif kafka is not None:
        given["sink"] = "kafka"
    if given.get("sink") == "kafka" and not (kafka if kafka is not None else
                                             _overrides.get("kafka") or _settings_from_env().kafka):
        raise ValueError("the Kafka sink needs bootstrap servers: configure(kafka='host:port') "
                         "or BCP_TELEMETRY_KAFKA")
    if spool_dir is not None:
        given["spool_dir"] = Path(spool_dir).absolute()
    _overrides.update({k: v for k, v in given.items() if v is not None})
    if queue_size is not None:
        _overrides["queue_size"] = queue_size
    if enabled is not None:
        _overrides["enabled"] = bool(enabled)
    s = _refresh()
    emitter.EMITTER.set_queue_size(s.queue_size)
    if isinstance(sink, Sink):
        _built_from[0] = None
        emitter.EMITTER.set_sink(sink)
    elif any(v is not None for v in given.values()) or (
            emitter.EMITTER.get_sink() is not None and _built_from[0] not in (None, _sink_settings(s))):
        # Asked for, or the environment changed under a sink built from it: (re)build now.
        emitter.EMITTER.set_sink(_build(s))


def reset() -> None:
    """Forget configure() overrides; the next event builds a sink from the environment (tests)."""
    _overrides.clear()
    _built_from[0] = None
    _refresh()
    emitter.EMITTER.set_queue_size(settings.queue_size)
    emitter.EMITTER.set_sink(None)


emitter.EMITTER.set_sink_factory(_start_sink)
