"""Storage backends, chosen by the URL scheme of a checkpoint path.

``/data/ckpt`` or ``file:///data/ckpt`` → local disk; ``mem://name`` → in-memory.
Backends register by scheme with an install hint, so an unknown or uninstalled scheme
fails with a message that says what to do.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ..errors import StorageError
from .base import CommitMode, Storage, Writer

__all__ = ["CommitMode", "Storage", "Writer", "open_storage", "register_backend", "split_url"]

# scheme -> (import path "module:Class", install hint)
_REGISTRY: dict[str, tuple[str | Callable[[], Storage], str]] = {
    "file": ("bytecheckpoint.storage.local:LocalStorage", ""),
    "mem": ("bytecheckpoint.storage.memory:MemoryStorage", ""),
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
    """The backend for ``url`` and the path within it."""
    scheme, path = split_url(url)
    entry = _REGISTRY.get(scheme)
    if entry is None:
        known = ", ".join(f"{s}://" for s in sorted(_REGISTRY))
        raise StorageError(f"no storage backend for {scheme}:// (known: {known})")
    target, hint = entry
    if callable(target):
        return target(), path
    module, _, cls = target.partition(":")
    try:
        backend = getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise StorageError(f"storage backend {scheme}:// is not installed: {hint or exc}") from exc
    return backend(), path
