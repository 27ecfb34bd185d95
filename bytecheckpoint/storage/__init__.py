"""Storage backends, chosen by the URL scheme of a checkpoint path.

``/data/ckpt`` or ``file:///data/ckpt`` → local disk; ``mem://name`` → in-memory (one
process); ``shm://name`` → shared memory (every process on the host); ``s3://bucket/key`` →
S3 or an S3-compatible store; ``hdfs://namenode:port/path`` → HDFS. Backends register by
scheme with an install hint, so an unknown or uninstalled scheme fails with a message that
says what to do. Every backend comes wrapped: retries for transient errors, one telemetry
event per operation, and injected faults when configured (see :mod:`.faults`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ..errors import InvalidStorageURLError, StorageError
from . import faults
from .base import CommitMode, Storage, Writer
from .config import settings
from .faults import FaultyStorage
from .managed import ManagedStorage
from .redact import redact

__all__ = ["CommitMode", "Storage", "Writer", "open_backend", "open_storage", "register_backend", "split_url"]

# scheme -> (import path "module:Class", install hint)
_REGISTRY: dict[str, tuple[str | Callable[[], Storage], str]] = {
    "file": ("bytecheckpoint.storage.local:LocalStorage", ""),
    "mem": ("bytecheckpoint.storage.memory:MemoryStorage", ""),
    "shm": ("bytecheckpoint.storage.shm:SharedMemoryStorage", ""),
    "s3": ("bytecheckpoint.storage.s3:S3Storage", "pip install 'bytecheckpoint[s3]' (needs pyarrow)"),
    "hdfs": ("bytecheckpoint.storage.hdfs:HdfsStorage",
             "pip install 'bytecheckpoint[hdfs]' (needs hdfs-native)"),
}


def register_backend(scheme: str, factory: Callable[[], Storage], *, clobber: bool = False) -> None:
    """Make ``scheme://`` paths use ``factory()``; refuses to replace a scheme silently."""
    if scheme in _REGISTRY and not clobber:
        raise ValueError(f"storage scheme {scheme!r} is already registered")
    _REGISTRY[scheme] = (factory, "")


def split_url(url: str) -> tuple[str, str]:
    """``"s3://bucket/x"`` → ``("s3", "bucket/x")``; a plain path → ``("file", path)``."""
    url = str(url)
    if "://" not in url:
        return "file", url
    scheme, rest = url.split("://", 1)
    return scheme.lower(), rest


def open_storage(url: str) -> tuple[Storage, str]:
    """The backend for ``url`` (retried, instrumented, with faults if configured) and the path
    within it."""
    backend, path = open_backend(url)
    injector = faults.active()
    if injector is not None:
        backend = FaultyStorage(backend, injector)
    return ManagedStorage(backend, settings().retry), path


def open_backend(url: str) -> tuple[Storage, str]:
    """The bare backend for ``url``, without retries, telemetry or faults."""
    scheme, path = split_url(url)
    entry = _REGISTRY.get(scheme)
    if entry is None:
        known = ", ".join(f"{s}://" for s in sorted(_REGISTRY))
        raise InvalidStorageURLError(redact(f"{url}: no storage backend for {scheme}:// (known: {known})"))
    target, hint = entry
    if callable(target):
        backend = target()
    else:
        module, _, cls = target.partition(":")
        try:
            backend = getattr(importlib.import_module(module), cls)()
        except ModuleNotFoundError as exc:
            raise StorageError(f"storage backend {scheme}:// is not installed: {hint or exc}") from exc
    backend.check_path(path)
    return backend, path
