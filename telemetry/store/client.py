"""Open a ClickHouse client from a DSN, with errors that say what is wrong and what to do."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

DSN_ENV = "BCP_CLICKHOUSE_DSN"
SCHEMES = ("chdb", "http", "https")


class StoreError(RuntimeError):
    """Base of telemetry store errors."""


class StoreConfigError(StoreError):
    """The DSN or the store's contents are wrong: retrying will not help."""


class StoreUnavailableError(StoreError):
    """The store cannot be reached right now (server down, embedded store held by a process)."""


def default_dsn() -> str:
    """$BCP_CLICKHOUSE_DSN, else an embedded store beside the spool directory."""
    dsn = os.environ.get(DSN_ENV, "").strip()
    if dsn:
        return dsn
    spool = os.environ.get("BCP_TELEMETRY_DIR", "").strip()
    base = Path(spool).parent if spool else Path.cwd() / ".bytecheckpoint"
    return f"chdb://{(base / 'store').absolute()}"


def normalize_dsn(dsn: str) -> str:
    """Check the scheme; make a chdb path absolute (``chdb://rel/dir`` would parse as host+db)."""
    dsn = (dsn or "").strip()
    if not dsn:
        raise StoreConfigError(f"no ClickHouse DSN: pass --dsn or set {DSN_ENV}, e.g. "
                               "chdb:///var/lib/bcp/store or http://user:pass@host:8123/bcp")
    scheme, sep, rest = dsn.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise StoreConfigError(f"unsupported ClickHouse DSN {_redact(dsn)!r}: use chdb:///ABS/PATH "
                               "(embedded) or http(s)://[user:pass@]host:port/database (server)")
    if scheme.lower() != "chdb" or rest in ("memory", ":memory:") or rest.startswith("memory/"):
        return dsn
    path, _, query = rest.partition("?")
    absolute = Path(path).expanduser().absolute()
    return f"chdb://{absolute}" + (f"?{query}" if query else "")


def connect(dsn: str, **kwargs: Any) -> Any:
    """A clickhouse-connect client for ``dsn``; raises StoreUnavailableError or StoreConfigError."""
    dsn = normalize_dsn(dsn)
    try:
        import clickhouse_connect
    except ImportError as exc:
        raise StoreConfigError("clickhouse-connect is not installed: pip install "
                               "'bytecheckpoint[ingest]'") from exc
    embedded = dsn.startswith("chdb:")
    if embedded:
        location = dsn[len("chdb://"):].partition("?")[0]
        if location.startswith("/"):
            Path(location).mkdir(parents=True, exist_ok=True)
    else:
        kwargs.setdefault("connect_timeout", 5)
        kwargs.setdefault("send_receive_timeout", 60)
    try:
        return clickhouse_connect.get_client(dsn=dsn, **kwargs)
    except ImportError as exc:
        raise StoreConfigError(f"{exc}; chdb:// DSNs need the chdb package "
                               "(pip install 'bytecheckpoint[ingest]')") from exc
    except Exception as exc:  # noqa: BLE001 - classified below, re-raised with the cause
        text = str(exc)
        if embedded and ("Cannot lock file" in text or "different path" in text
                         or "already running" in text):
            raise StoreUnavailableError(
                f"embedded store {dsn} is open in another process (chdb allows one process per "
                "store directory); stop that process, or query through the process that owns it"
            ) from exc
        if "Authentication" in text or "UNKNOWN_DATABASE" in text or "Code: 81" in text:
            raise StoreConfigError(f"ClickHouse at {_redact(dsn)} refused the connection: {text}") from exc
        raise StoreUnavailableError(f"cannot reach ClickHouse at {_redact(dsn)} ({type(exc).__name__}: "
                                    f"{text.splitlines()[0] if text else ''}); check the DSN and that "
                                    "the server is up") from exc


def _redact(dsn: str) -> str:
    scheme, sep, rest = dsn.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return dsn
    user = userinfo.partition(":")[0]
    return f"{scheme}{sep}{user}:***@{host}"
