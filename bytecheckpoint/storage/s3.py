"""S3 and S3-compatible object stores (``s3://bucket/key``) through ``pyarrow.fs.S3FileSystem``.

Object stores have no rename, so checkpoints commit by writing the metadata object last
(``CommitMode.MARKER``); a PUT of one object is atomic, which is what the commit and the
``latest`` pointer rely on.

- Writes: a writer buffers into parts of ``part_bytes`` (at least 5 MiB, S3's minimum) and
  hands each full part to pyarrow's multipart upload, which uploads parts concurrently on its
  I/O threads; the stream is flushed every ``threads`` parts to bound the memory held. Parts are
  retried by the AWS SDK's own retry strategy (a part cannot be replayed from here once the
  caller's buffer is gone). A file smaller than one part is a single PUT at commit, and that
  commit can be retried whole.
- Reads: one object handle, then ranged GETs of ``part_bytes`` on ``threads`` threads.
- Endpoint, region and credentials come from the environment or the config file
  (:mod:`.config`); without keys, pyarrow uses the AWS default chain (profile, IMDS).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import posixpath
import re
import sys
from collections.abc import Iterator
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from ..errors import (
    InvalidStorageSettingError,
    InvalidStorageURLError,
    PermanentStorageError,
    StorageError,
    StorageTimeoutError,
    TransientStorageError,
)
from . import parallel
from .base import COMMIT_MARKER_NAME, CommitMode, Storage, Writer
from .config import RetrySettings, S3Settings, TransferSettings, settings
from .redact import redact

MIN_PART_BYTES = 5 << 20
log = logging.getLogger("bytecheckpoint.storage")

# AWS error names pyarrow puts in its messages, and what a person should do about each.
_PERMANENT = {
    "NO_SUCH_BUCKET": "the bucket does not exist: create it, or fix the bucket name in the path",
    "ACCESS_DENIED": "access denied: grant this identity s3:GetObject/PutObject/ListBucket/"
                     "DeleteObject on the bucket, or use other credentials",
    "INVALID_ACCESS_KEY_ID": "the access key is not valid: check AWS_ACCESS_KEY_ID",
    "SIGNATURE_DOES_NOT_MATCH": "the secret key does not match the access key: check "
                                "AWS_SECRET_ACCESS_KEY",
    "EXPIRED_TOKEN": "the session token has expired: refresh the credentials",
    "INVALID_BUCKET_NAME": "the bucket name is not valid: fix the path",
}
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_FORBIDDEN = re.compile(r"HTTP response code:?\s*403|\b403\b.*Forbidden")
# A server asking for fewer requests (throttling) or briefly failing: waited for longer
# (``retry.BUSY_MAX_S``). A HEAD has no body, so its 503 reads "AWS Error UNKNOWN (HTTP status 503)".
_BUSY = re.compile(r"SLOW_DOWN|SlowDown|THROTTL|Throttl|REQUEST_LIMIT_EXCEEDED|"
                   r"HTTP (?:status|response code):?\s*(?:429|500|502|503|504)\b")


def _timed_out(text: str, what: str, endpoint: str, s3: S3Settings) -> StorageTimeoutError | None:
    """The error for a request curl gave up on (code 28): no connection within the connect
    timeout, or no byte within the request timeout (a server that accepts and never answers)."""
    if "curlCode: 28" not in text:
        return None
    if "too slow" in text:
        seconds = max(1, int(s3.request_timeout_s))  # the SDK's low-speed limit: whole seconds
        setting = "BCP_S3_REQUEST_TIMEOUT_S / [s3].request_timeout_s"
        how = "accepted the connection but did not answer"
    else:
        seconds, setting = s3.connect_timeout_s, "BCP_S3_CONNECT_TIMEOUT_S / [s3].connect_timeout_s"
        how = "did not accept a connection"
    return StorageTimeoutError(redact(
        f"{what}: the S3 endpoint {endpoint} {how} within {seconds:g} s ({setting}); check that the "
        f"server is up and not hung, and that this host can reach it, or raise {setting.split()[0]} "
        f"({text})"))


def _translate(exc: OSError, what: str, endpoint: str | None = None,
               s3: S3Settings | None = None) -> Exception:
    """Map a pyarrow error to a permanent or transient storage error with a plain message."""
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return exc
    text = str(exc)
    if endpoint and (timeout := _timed_out(text, what, endpoint, s3 or S3Settings())) is not None:
        return timeout
    if endpoint and "NETWORK_CONNECTION" in text:  # refused, unresolvable
        return TransientStorageError(redact(
            f"{what}: the connection to the S3 endpoint {endpoint} failed ({text}); check "
            "BCP_S3_ENDPOINT / AWS_ENDPOINT_URL, that the server is up and that this host can reach it"))
    for name, advice in _PERMANENT.items():
        if name in text:
            return PermanentStorageError(f"{what}: {advice} ({text})")
    if _FORBIDDEN.search(text):
        return PermanentStorageError(f"{what}: {_PERMANENT['ACCESS_DENIED']} ({text})")
    if "allow_bucket_creation" in text or "Bucket" in text and "not found" in text:
        return PermanentStorageError(f"{what}: {_PERMANENT['NO_SUCH_BUCKET']} ({text})")
    error = TransientStorageError(f"{what}: {text}")
    error.server_busy = bool(_BUSY.search(text))
    return error


@contextlib.contextmanager
def _errors(what: str, endpoint: str | None = None, s3: S3Settings | None = None) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        translated = _translate(exc, what, endpoint, s3)
        if translated is exc:
            raise
        raise translated from exc


def _endpoint(raw: str) -> tuple[str, str]:
    """``"http://host:port"`` → ``("host:port", "http")``; a bare ``host:port`` means https."""
    if "://" not in raw:
        return raw, "https"
    parts = urlsplit(raw)
    # The SDK would take "user:pass@host" for a host named "user" (a retried, misleading
    # "could not resolve host"), and would drop a path without a word.
    if "@" in parts.netloc or parts.scheme not in ("http", "https") or parts.path.strip("/"):
        raise InvalidStorageSettingError(redact(
            f"S3 endpoint {raw!r} is not valid: give scheme://host[:port] with scheme http or https "
            "(BCP_S3_ENDPOINT / AWS_ENDPOINT_URL / [s3].endpoint), no path, and the keys in "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"))
    return parts.netloc, parts.scheme


@functools.lru_cache(maxsize=8)
def _filesystem(s3: S3Settings, retry: RetrySettings, *, streaming: bool = False) -> pafs.S3FileSystem:
    """The client for whole operations (``streaming=False``): one HTTP attempt each, since the
    storage's own retry loop (BCP_STORAGE_RETRY_*) retries them; SDK retries under it multiplied
    the two (6 x 6 attempts, ~90 s to report an unreachable endpoint). The client for streamed
    multipart uploads (``streaming=True``) keeps the SDK's retries: a part cannot be replayed
    from here once the caller's buffer is gone."""
    kwargs: dict[str, object] = {
        "region": s3.region,
        "connect_timeout": s3.connect_timeout_s,
        "request_timeout": s3.request_timeout_s,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=retry.attempts if streaming else 1),
    }
    if s3.endpoint:
        kwargs["endpoint_override"], kwargs["scheme"] = _endpoint(s3.endpoint)
    if s3.access_key or s3.secret_key:
        if not (s3.access_key and s3.secret_key):
            raise PermanentStorageError(
                "S3 credentials are incomplete: set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or neither, to use the default AWS credential chain)"
            )
        kwargs.update(access_key=s3.access_key, secret_key=s3.secret_key, session_token=s3.session_token)
    return pafs.S3FileSystem(**{k: v for k, v in kwargs.items() if v is not None})


def _streamed(key: str) -> bool:
    """Whether a file is uploaded part by part while it is written. Not the metadata (the
    commit marker, which an overwrite PUTs over the committed one): pyarrow cannot abort a
    multipart upload, it completes one that is dropped, so a save interrupted part way would
    leave a truncated marker in place of the old. It goes up in one call at commit instead."""
    return posixpath.basename(key) != COMMIT_MARKER_NAME


class _S3Writer(Writer):
    def __init__(self, storage: S3Storage, path: str) -> None:
        self._storage, self._path = storage, path
        self._part = max(MIN_PART_BYTES, storage.transfer.part_bytes) if _streamed(path) else sys.maxsize
        self._buffer = bytearray()
        self._stream: pafs.NativeFile | None = None
        self._in_flight = 0
        self._size = 0
        self._broken: str | None = None

    def _check(self) -> None:
        if self._broken:
            raise PermanentStorageError(
                f"{self._storage.url(self._path)}: an earlier part upload failed after the S3 client's "
                f"own retries ({self._broken}); this file cannot be completed: write it again"
            )

    def _send(self, part: bytes) -> None:
        what = f"upload of {self._storage.url(self._path)}"
        try:
            with self._storage.errors(what):
                if self._stream is None:
                    self._stream = self._storage.stream_fs.open_output_stream(self._path)
                self._stream.write(part)  # uploaded as one part in the background
                self._in_flight += 1
                if self._in_flight >= self._storage.transfer.threads:
                    self._stream.flush()  # waits for the parts in flight: bounds memory
                    self._in_flight = 0
        except Exception as exc:
            self._broken = str(exc)
            raise

    def write(self, data: memoryview | bytes) -> None:
        self._check()
        mv = memoryview(data).cast("B")
        self._size += len(mv)
        while len(mv):
            take = min(len(mv), self._part - len(self._buffer))
            self._buffer += mv[:take]
            mv = mv[take:]
            if len(self._buffer) == self._part:
                part, self._buffer = bytes(self._buffer), bytearray()
                self._send(part)

    def commit(self) -> int:
        self._check()
        what = f"commit of {self._storage.url(self._path)}"
        if self._stream is None:
            # Small file: one PUT of the whole buffer; a failed attempt can be retried as is.
            # Written from the buffer itself, no copy between open and write: a stream dropped
            # by an interrupt is completed with what it holds (see _streamed).
            with self._storage.errors(what), self._storage.fs.open_output_stream(self._path) as stream:
                stream.write(self._buffer)
            return self._size
        try:
            with self._storage.errors(what):
                if self._buffer:
                    self._stream.write(bytes(self._buffer))
                    self._buffer = bytearray()
                self._stream.close()  # completes the multipart upload
        except Exception as exc:
            self._broken = str(exc)
            raise
        return self._size

    def abort(self) -> None:
        self._buffer = bytearray()
        stream, self._stream = self._stream, None
        if stream is None:
            return
        # pyarrow cannot abort a multipart upload (its stream has no abort()): a stream that is
        # closed or dropped completes it, leaving the parts sent as a truncated object. Complete
        # it here, then delete that object, so an aborted file is gone as the interface says.
        with contextlib.suppress(Exception):
            stream.close()
        try:
            with self._storage.errors(f"discarding {self._storage.url(self._path)}"):
                self._storage.fs.delete_file(self._path)
        except FileNotFoundError:
            pass
        except StorageError as exc:
            log.warning("%s", exc)


def _scatter(views: list[memoryview], start: int, data: memoryview) -> None:
    """Copy ``data``, the bytes at ``start`` of the span ``views`` cover back to back, into them."""
    base = 0
    end = start + len(data)
    for view in views:
        lo, hi = max(start, base), min(end, base + len(view))
        if lo < hi:
            view[lo - base : hi - base] = data[lo - start : hi - start]
        base += len(view)
        if base >= end:
            return


class S3Storage(Storage):
    scheme = "s3"
    commit_mode = CommitMode.MARKER

    def __init__(self, s3: S3Settings | None = None, transfer: TransferSettings | None = None,
                 retry: RetrySettings | None = None) -> None:
        conf = settings()
        self.transfer = transfer or conf.transfer
        s3, retry = s3 or conf.s3, retry or conf.retry
        self.endpoint = s3.endpoint or "AWS"
        self.s3 = s3  # its timeouts are named in errors
        self._buckets: set[str] = set()  # known to exist (_check_bucket)
        with self.errors("S3 client setup"):
            self.fs = _filesystem(s3, retry)
            self.stream_fs = _filesystem(s3, retry, streaming=True)

    def errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Translate pyarrow's errors; an unreachable endpoint is named in the message."""
        return _errors(what, self.endpoint, self.s3)

    def check_path(self, path: str) -> None:
        bucket = path.split("/", 1)[0]
        if not bucket:
            raise InvalidStorageURLError(f"s3://{path}: an s3:// URL needs a bucket, as in s3://bucket/prefix")
        if "@" in bucket or ":" in bucket:
            raise InvalidStorageURLError(
                "an s3:// URL takes no credentials or port: give s3://bucket/prefix, with the keys in "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the endpoint in BCP_S3_ENDPOINT")
        if not _BUCKET.fullmatch(bucket):
            raise InvalidStorageURLError(f"s3://{path}: {bucket!r} is not a valid bucket name (3-63 "
                                         "lowercase letters, digits, '.' and '-')")
        if "//" in path.strip("/"):  # pyarrow refuses such keys, late and without a word of advice
            raise InvalidStorageURLError(f"s3://{path}: an s3:// path has no empty parts ('//'); "
                                         "give s3://bucket/prefix/name")

    @staticmethod
    def _key(path: str) -> str:
        path = path.strip("/")
        if not path:
            raise InvalidStorageURLError("an s3:// path needs a bucket: s3://bucket/prefix")
        return path

    def open_writer(self, path: str) -> Writer:
        return _S3Writer(self, self._key(path))

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        key = self._key(path)
        with self.errors(f"read of {self.url(key)}"):
            handle = self.fs.open_input_file(key)

        def read_part(off: int, view: memoryview) -> int:
            with self.errors(f"read of {self.url(key)} at {off}"):
                data = handle.read_at(len(view), off)
            view[: len(data)] = memoryview(data)
            return len(data)

        try:
            there = handle.size() - offset
            if there <= 0:
                return 0
            # Only the bytes there are: a part past the end was "Cannot read past end of file",
            # retried as transient, where a truncated file should read short.
            return parallel.read_parts(read_part, offset, memoryview(buffer).cast("B")[:there], self.transfer)
        finally:
            handle.close()

    def read_into_many(self, path: str, offset: int, buffers: list[memoryview]) -> int:
        """One object handle (one HEAD) and ranged GETs of the whole span, each scattered over
        the buffers it covers: the default read every buffer on its own, a HEAD and a GET each
        (a load of many small tensors asked 2 requests per tensor)."""
        views = [memoryview(b).cast("B") for b in buffers]
        if len(views) < 2:
            return super().read_into_many(path, offset, buffers)
        key = self._key(path)
        with self.errors(f"read of {self.url(key)}"):
            handle = self.fs.open_input_file(key)
        try:
            there = min(sum(len(v) for v in views), max(0, handle.size() - offset))
            per_thread = -(-there // max(1, self.transfer.threads))
            parts = parallel.split(0, there, max(self.transfer.part_bytes, per_thread)) if there else []
            got = [0] * len(parts)

            def fetch(i: int, start: int, length: int) -> None:
                with self.errors(f"read of {self.url(key)} at {offset + start}"):
                    data = memoryview(handle.read_at(length, offset + start))
                _scatter(views, start, data)
                got[i] = len(data)

            parallel.run_parts([functools.partial(fetch, i, s, n) for i, (s, n) in enumerate(parts)],
                               self.transfer)
        finally:
            handle.close()
        total = 0
        for (_, n), g in zip(parts, got):
            total += g
            if g < n:  # the object shrank since its size was asked: stop at the gap
                break
        return total

    def _info(self, key: str) -> pafs.FileInfo:
        with self.errors(f"lookup of {self.url(key)}"):
            return self.fs.get_file_info(key)

    def size(self, path: str) -> int:
        key = self._key(path)
        info = self._info(key)
        if info.type == pafs.FileType.File:
            return info.size
        if info.type == pafs.FileType.Directory:
            raise IsADirectoryError(self.url(key))
        raise FileNotFoundError(self.url(key))

    def list_dir(self, path: str) -> list[str]:
        key = self._key(path)
        with self.errors(f"listing of {self.url(key)}"):
            infos = self.fs.get_file_info(pafs.FileSelector(key, allow_not_found=True))
        return sorted(i.base_name for i in infos)

    def is_dir(self, path: str) -> bool:
        key = self._key(path)
        info = self._info(key)
        if info.type == pafs.FileType.NotFound:
            self._check_bucket(key)
        return info.type == pafs.FileType.Directory

    def _check_bucket(self, key: str) -> None:
        """Raise if ``key``'s bucket does not exist: a load from a mistyped bucket said only "no
        such checkpoint". Asked where a path was not found (``is_dir`` is the question a load's
        diagnosis and ``exists`` end with), once per bucket that exists; a failed check says nothing."""
        bucket = key.split("/", 1)[0]
        if bucket in self._buckets:
            return
        try:
            found = self.fs.get_file_info(bucket).type != pafs.FileType.NotFound
        except OSError:
            return
        if not found:
            raise PermanentStorageError(f"{self.url(key)}: {_PERMANENT['NO_SUCH_BUCKET']}")
        self._buckets.add(bucket)

    def makedirs(self, path: str) -> None:
        key = self._key(path)
        with self.errors(f"creating {self.url(key)}"):
            self.fs.create_dir(key, recursive=True)

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        """Copy then delete: S3 has no rename, so this is not atomic. The commit protocol never
        relies on it (``CommitMode.MARKER``); it exists for tools that move single objects."""
        src, dst = self._key(src), self._key(dst)
        if self._info(src).type != pafs.FileType.File:
            raise StorageError(f"{self.url(src)}: only single objects can be renamed on S3")
        if not overwrite and self._info(dst).type != pafs.FileType.NotFound:
            raise FileExistsError(self.url(dst))
        with self.errors(f"rename of {self.url(src)}"):
            self.fs.move(src, dst)

    def delete(self, path: str) -> None:
        key = self._key(path)
        info = self._info(key)
        with self.errors(f"delete of {self.url(key)}"):
            if info.type == pafs.FileType.Directory:
                self.fs.delete_dir(key)
            elif info.type == pafs.FileType.File:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.delete_file(key)

