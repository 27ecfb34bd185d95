"""Read leases and pins: how a reader tells a tiering service to leave a checkpoint alone.

Both are small files next to the checkpoint directory, in its parent (the names starting
with ``.`` are reserved by the library, so they never look like checkpoints):

    .<name>.pin                      pinned: never cooled or deleted until the file is removed
    .<name>.lease-<host>-<pid>-<id>  being read: JSON ``{"host", "pid", "expires"}``

``bcp.load`` takes a lease for the whole load on local disk. A lease ends when its holder
deletes it, when it expires (``BCP_LEASE_TTL_S``, default 6 h), or when its process is gone
(checked on the same host only), so a reader that crashed never pins a checkpoint forever.
Taking a lease never fails a load: if the file cannot be written, the load goes on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import posixpath
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import InvalidSettingError
from ..storage import Storage, open_backend

LEASE_TAG = ".lease-"
PIN_SUFFIX = ".pin"
TTL_ENV = "BCP_LEASE_TTL_S"
DEFAULT_TTL_S = 6 * 3600.0
# Backends whose checkpoints a tiering service can move (a lease elsewhere would cost a PUT).
LEASED_SCHEMES = ("file",)

log = logging.getLogger(__name__)


def _split(path: str) -> tuple[str, str]:
    parent, name = posixpath.split(path.rstrip("/"))
    return parent, name


def pin_path(path: str) -> str:
    parent, name = _split(path)
    return posixpath.join(parent, f".{name}{PIN_SUFFIX}")


def lease_prefix(path: str) -> str:
    parent, name = _split(path)
    return posixpath.join(parent, f".{name}{LEASE_TAG}")


@dataclass(frozen=True)
class Lease:
    path: str
    host: str
    pid: int
    expires: float

    def active(self, now: float | None = None) -> bool:
        if (now if now is not None else time.time()) >= self.expires:
            return False
        if self.host == socket.gethostname():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True  # alive, owned by another user
        return True


MAX_LEASE_BYTES = 64 << 10  # a lease is a few dozen bytes of JSON


def list_leases(storage: Storage, path: str) -> list[Lease]:
    """Every lease file on the checkpoint at ``path``, active or not."""
    parent, name = _split(path)
    prefix = f".{name}{LEASE_TAG}"
    leases = []
    for entry in storage.list_dir(parent):
        if not entry.startswith(prefix):
            continue
        full = posixpath.join(parent, entry)
        try:
            raw = storage.read_small(full, MAX_LEASE_BYTES)
            if raw is None:
                raise ValueError("too large for a lease")
            doc = json.loads(raw.decode())
            leases.append(Lease(full, str(doc["host"]), int(doc["pid"]), float(doc["expires"])))
        except FileNotFoundError:
            continue  # released while we listed
        except (ValueError, KeyError, TypeError):
            # Half-written by a reader that is creating it right now: count it as active.
            leases.append(Lease(full, "", 0, float("inf")))
    return leases


def is_being_read(storage: Storage, path: str, now: float | None = None) -> bool:
    return any(lease.active(now) for lease in list_leases(storage, path))


def is_pinned(storage: Storage, path: str) -> bool:
    return storage.exists(pin_path(path))


def pin(url: str, reason: str = "") -> str:
    """Pin the checkpoint at ``url``: a tiering service never moves or deletes it."""
    storage, path = open_backend(url)
    target = pin_path(path)
    doc = {"reason": reason, "by": f"{socket.gethostname()}:{os.getpid()}", "time": time.time()}
    storage.write_bytes(target, json.dumps(doc).encode())
    return storage.url(target)


def unpin(url: str) -> bool:
    """Remove a pin; return whether there was one."""
    storage, path = open_backend(url)
    target = pin_path(path)
    existed = storage.exists(target)
    storage.delete(target)
    return existed


def _ttl() -> float:
    """``BCP_LEASE_TTL_S``, checked: a 0, negative or NaN lease would expire at once and leave a
    checkpoint being read unprotected from gc and tiering."""
    raw = os.environ.get(TTL_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_TTL_S
    except ValueError:
        value = 0.0
    if not 0 < value < math.inf:  # an infinite lease would never lapse (a dead reader's on S3)
        raise InvalidSettingError(f"{TTL_ENV} = {raw!r} is not a finite number of seconds > 0: give how long "
                                  f"a read lease protects a checkpoint (default {DEFAULT_TTL_S:.0f}), or "
                                  "unset it")
    return value


@contextlib.contextmanager
def read_lease(storage: Storage, path: str, ttl_s: float | None = None) -> Iterator[str | None]:
    """Hold a read lease on the checkpoint at ``path`` for the body; yields the lease file,
    or None where none could be taken (the caller reads all the same)."""
    host = socket.gethostname()
    full = f"{lease_prefix(path)}{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    doc = {"host": host, "pid": os.getpid(), "expires": time.time() + (ttl_s or _ttl())}
    try:
        storage.write_bytes(full, json.dumps(doc).encode())
    except OSError as exc:
        log.warning("no read lease on %s (%s); loading without one", storage.url(path), exc)
        yield None
        return
    try:
        yield full
    finally:
        try:
            storage.delete(full)
        except OSError as exc:  # it expires on its own
            log.warning("could not release read lease %s: %s", full, exc)


@contextlib.contextmanager
def lease_for_load(url: str) -> Iterator[str | None]:
    """The lease ``bcp.load`` holds: on a local checkpoint, or the one ``latest`` names.

    Looked up on the bare backend, so it adds no I/O events and meets no injected faults."""
    from ..format.metadata import METADATA_FILE
    from .integrity import read_latest  # integrity imports storage; keep this module light

    storage, path = open_backend(url)
    if storage.scheme not in LEASED_SCHEMES:
        yield None
        return
    path = path.rstrip("/") or path
    try:
        if not storage.exists(posixpath.join(path, METADATA_FILE)):
            latest = read_latest(storage, path)
            path = posixpath.join(path, latest.name) if latest is not None else ""
    except Exception:  # the load itself reports what is wrong with the path
        path = ""
    if not path or not storage.exists(posixpath.join(path, METADATA_FILE)):
        yield None
        return
    with read_lease(storage, path) as lease:
        yield lease
