"""Runtime configuration: environment defaults plus configure() overrides."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from telemetry import emitter
from telemetry.sinks.base import Sink
from telemetry.sinks.spool import DEFAULT_MAX_BYTES, SpoolSink

_OFF_VALUES = frozenset({"off", "0", "false", "no", "disabled"})


@dataclass
class Settings:
    enabled: bool
    spool_dir: Path
    spool_max_bytes: int
    queue_size: int


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


def _settings_from_env() -> Settings:
    spool_dir = os.environ.get("BCP_TELEMETRY_DIR", "").strip()
    return Settings(
        enabled=os.environ.get("BCP_TELEMETRY", "on").strip().lower() not in _OFF_VALUES,
        # Resolved once so a later chdir() does not scatter spool files.
        spool_dir=Path(spool_dir or Path.cwd() / ".bytecheckpoint" / "telemetry").absolute(),
        spool_max_bytes=_env_positive_int("BCP_TELEMETRY_SPOOL_MAX_BYTES", DEFAULT_MAX_BYTES),
        queue_size=_env_positive_int("BCP_TELEMETRY_QUEUE", emitter.DEFAULT_QUEUE_SIZE),
    )


# Mutated in place (never rebound) so modules holding a reference see every change.
settings = _settings_from_env()


def configure(
    sink: Sink | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    enabled: bool | None = None,
    queue_size: int | None = None,
    spool_max_bytes: int | None = None,
) -> None:
    """Change telemetry settings at runtime; arguments left as None keep their value.

    ``sink`` installs a custom sink; ``spool_dir``/``spool_max_bytes`` switch to (or
    re-create) the spool sink. Events already queued are flushed to the old sink first.
    """
    if sink is not None and (spool_dir is not None or spool_max_bytes is not None):
        raise ValueError("pass either sink or spool_dir/spool_max_bytes, not both")
    if spool_max_bytes is not None and spool_max_bytes <= 0:
        raise ValueError("spool_max_bytes must be positive")
    if queue_size is not None:
        emitter.EMITTER.set_queue_size(queue_size)
        settings.queue_size = queue_size
    if sink is not None:
        emitter.EMITTER.set_sink(sink)
    elif spool_dir is not None or spool_max_bytes is not None:
        if spool_dir is not None:
            settings.spool_dir = Path(spool_dir).absolute()
        if spool_max_bytes is not None:
            settings.spool_max_bytes = spool_max_bytes
        emitter.EMITTER.set_sink(SpoolSink(settings.spool_dir, settings.spool_max_bytes))
    if enabled is not None:
        settings.enabled = bool(enabled)


def reset() -> None:
    """Return to the environment-derived defaults (used by tests between cases)."""
    fresh = _settings_from_env()
    emitter.EMITTER.set_queue_size(fresh.queue_size)
    emitter.EMITTER.set_sink(SpoolSink(fresh.spool_dir, fresh.spool_max_bytes))
    settings.enabled = fresh.enabled
    settings.spool_dir = fresh.spool_dir
    settings.spool_max_bytes = fresh.spool_max_bytes
    settings.queue_size = fresh.queue_size


def _install_defaults() -> None:
    emitter.EMITTER.set_queue_size(settings.queue_size)
    # SpoolSink touches the filesystem only on its first write.
    emitter.EMITTER.set_sink(SpoolSink(settings.spool_dir, settings.spool_max_bytes))


_install_defaults()
