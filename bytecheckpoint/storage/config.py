"""Storage settings: transfer sizes, retry policy, and per-backend endpoints and credentials.

Values come from a TOML file named by ``BCP_STORAGE_CONFIG`` and from environment variables,
which win over the file. Nothing here is ever put into an event or an error message except
the names of settings: credentials stay in :class:`S3Settings` fields that ``repr`` hides.

    [transfer]              # BCP_STORAGE_PART_BYTES, BCP_STORAGE_THREADS,
    part_bytes = 67108864   # BCP_STORAGE_WRITE_BEHIND_BYTES
    threads = 4
    write_behind_bytes = 67108864   # 0: leave writeback to the kernel until fsync
    drop_behind = true      # BCP_STORAGE_DROP_BEHIND: recycle page-cache pages
    direct_writes = "async" # BCP_STORAGE_DIRECT_WRITES: large writes of async saves skip the page cache
    host_writers = 4        # BCP_STORAGE_HOST_WRITERS: large local files written at once per host
    [retry]                 # BCP_STORAGE_RETRY_ATTEMPTS, _BASE_S, _MAX_S, _DEADLINE_S
    attempts = 6
    [s3]                    # BCP_S3_ENDPOINT or AWS_ENDPOINT_URL; AWS_ACCESS_KEY_ID, ...
    endpoint = "http://127.0.0.1:9000"
    region = "us-east-1"
    connect_timeout_s = 5   # BCP_S3_CONNECT_TIMEOUT_S
    request_timeout_s = 20  # BCP_S3_REQUEST_TIMEOUT_S
    [hdfs]                  # BCP_HDFS_URL
    url = "hdfs://namenode:8020"
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ..errors import InvalidStorageSettingError

CONFIG_ENV = "BCP_STORAGE_CONFIG"


@dataclass(frozen=True)
class TransferSettings:
    """How large reads and writes are split: parts of ``part_bytes`` on ``threads`` threads.

    ``write_behind_bytes``: a local file being written asks the kernel to start writing back
    every this many bytes (``sync_file_range``), so the disk works while the writer is still
    filling the page cache and the final fsync has little left to do. 0 turns it off.

    ``drop_behind``: pages of a local file already written back (or read) are dropped from
    the page cache as the transfer goes on, so it runs through a small reused window instead
    of allocating new cache pages for every byte (see ``writeback``).

    ``direct_writes``: the aligned middle of a large write to a local file goes to the disk
    straight from the caller's memory (``O_DIRECT``) where the file system says how (see
    ``direct_io``), with no copy into the page cache. ``direct_sync_writes``: also in saves
    that training waits for (``BCP_STORAGE_DIRECT_WRITES=1``; the default, ``async``, writes
    those through the page cache). Direct writes spare the CPU a background save takes from
    training; a waited-for save wants only the wall time, and on a disk that serves several
    buffered streams faster than direct ones (this VM's: 1.47 against 1.72 s for 3.56 GB,
    ``bench/save_vs_write_limit.py``) the page cache is faster.

    ``host_writers``: in saves training waits for, at most this many large local files are
    written at once to one file system by all the processes of a host (``write_slots``);
    0: no limit."""

    part_bytes: int = 64 << 20
    threads: int = 4
    write_behind_bytes: int = 64 << 20
    drop_behind: bool = True
    direct_writes: bool = True
    direct_sync_writes: bool = False
    host_writers: int = 4

    @property
    def parallel(self) -> bool:
        return self.threads > 1


@dataclass(frozen=True)
class RetrySettings:
    """Exponential backoff with full jitter, bounded by attempts and by total time."""

    attempts: int = 6
    base_s: float = 0.05
    max_s: float = 2.0
    deadline_s: float = 120.0


@dataclass(frozen=True)
class S3Settings:
    """Where S3 is and how long one request may wait on it. ``connect_timeout_s``: to open a
    connection. ``request_timeout_s``: how long a request may go without receiving a byte (the
    AWS SDK's low-speed limit, in whole seconds, at least 1), not its total time: a large
    transfer that keeps moving never hits it, a hung server fails each attempt after it."""

    endpoint: str | None = None  # "http://host:port" for S3-compatible stores; None for AWS
    region: str | None = None
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    # A training job wants a dead or hung endpoint reported in seconds, not minutes; an S3
    # answers a request's first byte in well under a second even when busy (a busy one says
    # SlowDown, which is retried).
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 20.0


@dataclass(frozen=True)
class HdfsSettings:
    url: str | None = None  # default name node when a path has no authority (hdfs:///x)


@dataclass(frozen=True)
class StorageSettings:
    transfer: TransferSettings = TransferSettings()
    retry: RetrySettings = RetrySettings()
    s3: S3Settings = S3Settings()
    hdfs: HdfsSettings = HdfsSettings()


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _number(source: str, raw: Any, kind: type) -> Any:
    what = "a whole number" if kind is int else "a number"
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise InvalidStorageSettingError(f"storage setting {source}={raw!r} is not a valid {kind.__name__}: "
                                         f"give {what} above 0, or unset it for the default") from None
    # nan passes "<= 0" and would disable every limit; inf makes a backoff sleep overflow
    if not 0 < value < math.inf:
        raise InvalidStorageSettingError(f"storage setting {source}={raw!r} must be positive: give "
                                         f"{what} above 0, or unset it for the default")
    return value


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise InvalidStorageSettingError(f"{CONFIG_ENV} names {path!r}, which does not exist") from None
    except OSError as exc:  # a directory, no permission
        raise InvalidStorageSettingError(f"{CONFIG_ENV} names {path!r}, which cannot be read "
                                         f"({exc.strerror or exc}); name a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidStorageSettingError(f"storage config {path!r} is not valid TOML: {exc}") from None


# The keys each section of the file may hold; [tiering] belongs to the tiering service.
_KEYS = {
    "transfer": ("part_bytes", "threads", "write_behind_bytes", "drop_behind", "direct_writes",
                 "host_writers"),
    "retry": ("attempts", "base_s", "max_s", "deadline_s"),
    "s3": ("endpoint", "region", "access_key", "secret_key", "session_token", "connect_timeout_s",
           "request_timeout_s"),
    "hdfs": ("url",),
}


def _check_sections(doc: dict[str, Any], path: str) -> None:
    """Refuse what would be silently ignored: an unknown section or key is a typo."""
    for name, section in doc.items():
        if name == "tiering":
            continue
        if name not in _KEYS:
            raise InvalidStorageSettingError(f"storage config {path!r}: unknown section [{name}]; known: "
                               f"{', '.join(_KEYS)}")
        if not isinstance(section, dict):
            raise InvalidStorageSettingError(f"storage config {path!r}: [{name}] must be a table of settings")
        unknown = sorted(set(section) - set(_KEYS[name]))
        if unknown:
            raise InvalidStorageSettingError(f"storage config {path!r}: unknown setting(s) {unknown} in "
                                             f"[{name}]; known: {', '.join(_KEYS[name])}")


def _flag(name: str, raw: Any, default: bool) -> bool:
    if raw is None:
        return default
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise InvalidStorageSettingError(f"{name} = {raw!r} is not a valid flag: use 1 or 0")


def _direct_writes(raw: Any) -> str:
    """``BCP_STORAGE_DIRECT_WRITES``: "async" (the default), "1" (also in synchronous saves)
    or "0" (never)."""
    if raw is None or str(raw).strip().lower() == "async":
        return "async"
    name = "BCP_STORAGE_DIRECT_WRITES / [transfer].direct_writes"
    try:
        return "1" if _flag(name, raw, True) else "0"
    except InvalidStorageSettingError:
        raise InvalidStorageSettingError(f"{name} = {raw!r} is not valid: use async, 1 or 0") from None


def _count_or_off(name: str, raw: Any, default: int) -> int:
    if raw is None:
        return default
    if str(raw).strip() == "0":
        return 0  # off
    return _number(name, raw, int)


@functools.lru_cache(maxsize=8)
def _load(key: tuple[tuple[str, str], ...]) -> StorageSettings:
    env = dict(key)
    doc = _read_file(env[CONFIG_ENV]) if env.get(CONFIG_ENV) else {}
    _check_sections(doc, env.get(CONFIG_ENV, ""))
    sections = {name: dict(doc.get(name, {})) for name in ("transfer", "retry", "s3", "hdfs")}

    def pick(section: str, name: str, env_name: str, kind: type | None = None) -> Any:
        raw = env.get(env_name, sections[section].get(name))
        if raw is None or kind is None:
            return raw
        return _number(env_name if env_name in env else f"[{section}].{name}", raw, kind)

    d_transfer, d_retry = TransferSettings(), RetrySettings()
    direct = _direct_writes(pick("transfer", "direct_writes", "BCP_STORAGE_DIRECT_WRITES"))
    transfer = TransferSettings(
        part_bytes=pick("transfer", "part_bytes", "BCP_STORAGE_PART_BYTES", int) or d_transfer.part_bytes,
        threads=pick("transfer", "threads", "BCP_STORAGE_THREADS", int) or d_transfer.threads,
        write_behind_bytes=_count_or_off(
            "BCP_STORAGE_WRITE_BEHIND_BYTES / [transfer].write_behind_bytes",
            pick("transfer", "write_behind_bytes", "BCP_STORAGE_WRITE_BEHIND_BYTES"),
            d_transfer.write_behind_bytes),
        drop_behind=_flag("BCP_STORAGE_DROP_BEHIND / [transfer].drop_behind",
                          pick("transfer", "drop_behind", "BCP_STORAGE_DROP_BEHIND"),
                          d_transfer.drop_behind),
        direct_writes=direct != "0",
        direct_sync_writes=direct == "1",
        host_writers=_count_or_off("BCP_STORAGE_HOST_WRITERS / [transfer].host_writers",
                                   pick("transfer", "host_writers", "BCP_STORAGE_HOST_WRITERS"),
                                   d_transfer.host_writers),
    )
    retry = RetrySettings(
        attempts=pick("retry", "attempts", "BCP_STORAGE_RETRY_ATTEMPTS", int) or d_retry.attempts,
        base_s=pick("retry", "base_s", "BCP_STORAGE_RETRY_BASE_S", float) or d_retry.base_s,
        max_s=pick("retry", "max_s", "BCP_STORAGE_RETRY_MAX_S", float) or d_retry.max_s,
        deadline_s=pick("retry", "deadline_s", "BCP_STORAGE_RETRY_DEADLINE_S", float) or d_retry.deadline_s,
    )
    d_s3 = S3Settings()
    s3 = S3Settings(
        endpoint=env.get("BCP_S3_ENDPOINT") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        or sections["s3"].get("endpoint"),
        region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or sections["s3"].get("region"),
        access_key=env.get("AWS_ACCESS_KEY_ID") or sections["s3"].get("access_key"),
        secret_key=env.get("AWS_SECRET_ACCESS_KEY") or sections["s3"].get("secret_key"),
        session_token=env.get("AWS_SESSION_TOKEN") or sections["s3"].get("session_token"),
        connect_timeout_s=pick("s3", "connect_timeout_s", "BCP_S3_CONNECT_TIMEOUT_S", float)
        or d_s3.connect_timeout_s,
        request_timeout_s=pick("s3", "request_timeout_s", "BCP_S3_REQUEST_TIMEOUT_S", float)
        or d_s3.request_timeout_s,
    )
    hdfs = HdfsSettings(url=env.get("BCP_HDFS_URL") or sections["hdfs"].get("url"))
    return StorageSettings(transfer, retry, s3, hdfs)


_ENV_NAMES = (
    CONFIG_ENV, "BCP_STORAGE_PART_BYTES", "BCP_STORAGE_THREADS", "BCP_STORAGE_WRITE_BEHIND_BYTES",
    "BCP_STORAGE_DROP_BEHIND", "BCP_STORAGE_DIRECT_WRITES", "BCP_STORAGE_HOST_WRITERS",
    "BCP_STORAGE_RETRY_ATTEMPTS", "BCP_STORAGE_RETRY_BASE_S", "BCP_STORAGE_RETRY_MAX_S",
    "BCP_STORAGE_RETRY_DEADLINE_S",
    "BCP_S3_ENDPOINT", "BCP_S3_CONNECT_TIMEOUT_S", "BCP_S3_REQUEST_TIMEOUT_S",
    "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "BCP_HDFS_URL",
)


def settings() -> StorageSettings:
    """The settings in force now (re-read when the environment changes, cached otherwise)."""
    return _load(tuple((n, v) for n in _ENV_NAMES if (v := _env(n)) is not None))
