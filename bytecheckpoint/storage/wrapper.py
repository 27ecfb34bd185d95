"""A storage that forwards every primitive to another one through a single hook."""

from __future__ import annotations

import copy
from collections.abc import Callable
from fractions import Fraction
from typing import TypeVar

from .base import Storage, Writer

T = TypeVar("T")


class StorageWrapper(Storage):
    """Forwards to ``inner``; subclasses override ``_call`` (and ``open_writer``) to add
    behaviour around each operation. Identity (scheme, commit mode, URLs) is the inner one."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.scheme = inner.scheme  # type: ignore[misc]
        self.commit_mode = inner.commit_mode  # type: ignore[misc]
        self.buffered_writes = inner.buffered_writes  # type: ignore[misc]

    def _call(self, op: str, path: str, fn: Callable[[], T], nbytes: int | None = None) -> T:
        return fn()

    def open_writer(self, path: str) -> Writer:
        return self.inner.open_writer(path)

    def for_waited_writes(self, share_of_host: Fraction | None = None) -> Storage:
        inner = self.inner.for_waited_writes(share_of_host)
        if inner is self.inner:
            return self
        dup = copy.copy(self)
        dup.inner = inner
        return dup

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        return self._call("read_into", path, lambda: self.inner.read_into(path, offset, buffer),
                          nbytes=len(memoryview(buffer).cast("B")))

    def read_into_many(self, path: str, offset: int, buffers: list[memoryview]) -> int:
        # The same operation as far as retries, events and faults go: a positional read.
        nbytes = sum(len(memoryview(b).cast("B")) for b in buffers)
        return self._call("read_into", path, lambda: self.inner.read_into_many(path, offset, buffers),
                          nbytes=nbytes)

    def size(self, path: str) -> int:
        return self._call("size", path, lambda: self.inner.size(path))

    def list_dir(self, path: str) -> list[str]:
        return self._call("list_dir", path, lambda: self.inner.list_dir(path))

    def is_dir(self, path: str) -> bool:
        return self._call("is_dir", path, lambda: self.inner.is_dir(path))

    def makedirs(self, path: str) -> None:
        return self._call("makedirs", path, lambda: self.inner.makedirs(path))

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        return self._call("rename", src, lambda: self.inner.rename(src, dst, overwrite=overwrite))

    def exchange(self, a: str, b: str) -> bool:
        # A failed renameat2 changed nothing, so a retry of it is safe.
        return self._call("exchange", a, lambda: self.inner.exchange(a, b))

    def delete(self, path: str) -> None:
        return self._call("delete", path, lambda: self.inner.delete(path))

    def url(self, path: str) -> str:
        return self.inner.url(path)
