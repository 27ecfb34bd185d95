"""Runtime configuration: environment defaults plus configure() overrides.

| variable | meaning |
| --- | --- |
| BCP_TELEMETRY | on (default) / off |
| BCP_TELEMETRY_DIR | spool directory (also where the Kafka sink keeps what it could not send) |
| BCP_TELEMETRY_SINK | "spool" (default) or "kafka" (the default when BCP_TELEMETRY_KAFKA is set) |
| BCP_TELEMETRY_KAFKA | Kafka bootstrap servers, "host:port[,host:port]" |
| BCP_TELEMETRY_TOPIC | Kafka topic (default "bcp-telemetry") |
| BCP_TELEMETRY_SPOOL_MAX_BYTES | size of one spool file before rotation |
| BCP_TELEMETRY_SPOOL_LIMIT_BYTES | total unsent bytes the Kafka sink keeps before dropping |
| BCP_TELEMETRY_QUEUE | in-memory queue length |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from telemetry import emitter
from telemetry.sinks.base import Sink
from telemetry.sinks.kafka import DEFAULT_SPOOL_LIMIT, DEFAULT_TOPIC, KafkaSink
from telemetry.sinks.spool import DEFAULT_MAX_BYTES, SpoolSink

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


def _env_positive_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        # A typo in an env var must not take the training job down.
        return default
    return value if value > 0 else default


SINKS = ("spool", "kafka")


def _settings_from_env() -> Settings:
    spool_dir = os.environ.get("BCP_TELEMETRY_DIR", "").strip()
    kafka = os.environ.get("BCP_TELEMETRY_KAFKA", "").strip()
    sink = os.environ.get("BCP_TELEMETRY_SINK", "").strip().lower() or ("kafka" if kafka else "spool")
    if sink not in SINKS or (sink == "kafka" and not kafka):
        # A bad setting must not take the training job down: keep events locally.
        sink = "spool"
    return Settings(
        sink=sink,
        kafka=kafka,
        topic=os.environ.get("BCP_TELEMETRY_TOPIC", "").strip() or DEFAULT_TOPIC,
        spool_limit_bytes=_env_positive_int("BCP_TELEMETRY_SPOOL_LIMIT_BYTES", DEFAULT_SPOOL_LIMIT),
        enabled=os.environ.get("BCP_TELEMETRY", "on").strip().lower() not in _OFF_VALUES,
        # Resolved once so a later chdir() does not scatter spool files.
        spool_dir=Path(spool_dir or Path.cwd() / ".bytecheckpoint" / "telemetry").absolute(),
        spool_max_bytes=_env_positive_int("BCP_TELEMETRY_SPOOL_MAX_BYTES", DEFAULT_MAX_BYTES),
        queue_size=_env_positive_int("BCP_TELEMETRY_QUEUE", emitter.DEFAULT_QUEUE_SIZE),
    )


# Mutated in place (never rebound) so modules holding a reference see every change.
settings = _settings_from_env()


def build_sink(s: Settings) -> Sink:
    """The sink ``s`` describes: the spool, or Kafka with the spool as its fallback."""
    if s.sink == "kafka":
        return KafkaSink(s.kafka, s.topic, s.spool_dir, spool_limit_bytes=s.spool_limit_bytes,
                         spool_file_bytes=s.spool_max_bytes)
    return SpoolSink(s.spool_dir, s.spool_max_bytes)


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
) -> None:
    """Change telemetry settings at runtime; arguments left as None keep their value.

    ``sink`` is a Sink instance, or "spool" / "kafka". ``kafka`` (bootstrap servers) implies
    the Kafka sink; ``spool_dir`` is where the spool, or Kafka's unsent events, go. Events
    already queued are flushed to the old sink first.
    """
    if isinstance(sink, Sink):
        if any(v is not None for v in (spool_dir, spool_max_bytes, kafka, topic, spool_limit_bytes)):
            raise ValueError("pass either a Sink instance or sink settings, not both")
    elif sink is not None and sink not in SINKS:
        raise ValueError(f"unknown telemetry sink {sink!r}; use one of {', '.join(SINKS)} or a Sink")
    for name, value in (("spool_max_bytes", spool_max_bytes), ("spool_limit_bytes", spool_limit_bytes)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive")
    if queue_size is not None:
        emitter.EMITTER.set_queue_size(queue_size)
        settings.queue_size = queue_size
    if isinstance(sink, Sink):
        emitter.EMITTER.set_sink(sink)
    elif any(v is not None for v in (sink, spool_dir, spool_max_bytes, kafka, topic, spool_limit_bytes)):
        if spool_dir is not None:
            settings.spool_dir = Path(spool_dir).absolute()
        if spool_max_bytes is not None:
            settings.spool_max_bytes = spool_max_bytes
        if spool_limit_bytes is not None:
            settings.spool_limit_bytes = spool_limit_bytes
        if topic is not None:
            settings.topic = topic
        if kafka is not None:
            settings.kafka = kafka
            settings.sink = "kafka" if sink is None else sink
        elif sink is not None:
            settings.sink = sink
        if settings.sink == "kafka" and not settings.kafka:
            raise ValueError("the Kafka sink needs bootstrap servers: configure(kafka='host:port') "
                             "or BCP_TELEMETRY_KAFKA")
        emitter.EMITTER.set_sink(build_sink(settings))
    if enabled is not None:
        settings.enabled = bool(enabled)


def reset() -> None:
    """Return to the environment-derived defaults (used by tests between cases)."""
    fresh = _settings_from_env()
    emitter.EMITTER.set_queue_size(fresh.queue_size)
    emitter.EMITTER.set_sink(build_sink(fresh))
    settings.__dict__.update(fresh.__dict__)


def _install_defaults() -> None:
    emitter.EMITTER.set_queue_size(settings.queue_size)
    # Sinks touch the filesystem or network only on their first write.
    emitter.EMITTER.set_sink(build_sink(settings))


_install_defaults()
