"""In-memory storage (``mem://``): a process-wide namespace of byte buffers.

For in-memory checkpoints within one process (tests, fast local snapshots). Renames are
atomic under a lock, like a POSIX directory rename.
"""

from __future__ import annotations

import posixpath
import threading

from .base import CommitMode, Storage, Writer

_LOCK = threading.RLock()
_FILES: dict[str, bytes] = {}
_DIRS: set[str] = {""}


def _key(path: str) -> str:
    """The one name of ``path`` in the namespace: ``a//b``, ``a/./b`` and ``x/../a/b`` are ``a/b``,
    as on a file system (else a checkpoint saved through one spelling is missing through another,
    ``latest`` included); ``..`` never climbs above the namespace's root."""
    return posixpath.normpath("/" + path).lstrip("/")


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


class _MemoryWriter(Writer):
    def __init__(self, storage: MemoryStorage, path: str) -> None:
        self._storage = storage
        self._path = path
        self._parts: list[bytes] = []

    def write(self, data: memoryview | bytes) -> None:
        self._parts.append(bytes(data))

    def commit(self) -> int:
        data = b"".join(self._parts)
        with _LOCK:
            self._storage.makedirs(_parent(self._path))
            _FILES[self._path] = data
        return len(data)

    def abort(self) -> None:
        self._parts.clear()


class MemoryStorage(Storage):
    scheme = "mem"
    commit_mode = CommitMode.RENAME
    buffered_writes = True  # write() keeps a copy of the bytes

    def open_writer(self, path: str) -> Writer:
        return _MemoryWriter(self, _key(path))

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        with _LOCK:
            data = _FILES.get(_key(path))
        if data is None:
            raise FileNotFoundError(self.url(path))
        chunk = data[offset : offset + len(buffer)]
        memoryview(buffer).cast("B")[: len(chunk)] = chunk
        return len(chunk)

    def size(self, path: str) -> int:
        path = _key(path)
        with _LOCK:
            if path in _FILES:
                return len(_FILES[path])
            if path in _DIRS:
                raise IsADirectoryError(self.url(path))
        raise FileNotFoundError(self.url(path))

    def list_dir(self, path: str) -> list[str]:
        path = _key(path)
        prefix = f"{path}/" if path else ""
        with _LOCK:
            names = {p[len(prefix) :].split("/", 1)[0] for p in (*_FILES, *_DIRS) if p.startswith(prefix)}
        names.discard("")
        return sorted(names)

    def is_dir(self, path: str) -> bool:
        with _LOCK:
            return _key(path) in _DIRS

    def makedirs(self, path: str) -> None:
        path = _key(path)
        with _LOCK:
            while path not in _DIRS:
                _DIRS.add(path)
                path = _parent(path)

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        src, dst = _key(src), _key(dst)
        with _LOCK:
            if overwrite and src in _FILES and dst not in _DIRS:
                _FILES.pop(dst, None)
            if dst in _FILES or dst in _DIRS:
                raise FileExistsError(self.url(dst))
            if src in _FILES:
                self.makedirs(_parent(dst))
                _FILES[dst] = _FILES.pop(src)
                return
            if src not in _DIRS:
                raise FileNotFoundError(self.url(src))
            self.makedirs(_parent(dst))
            for p in [p for p in _FILES if p.startswith(src + "/")]:
                _FILES[dst + p[len(src) :]] = _FILES.pop(p)
            for d in [d for d in _DIRS if d == src or d.startswith(src + "/")]:
                _DIRS.discard(d)
                _DIRS.add(dst + d[len(src) :])

    def delete(self, path: str) -> None:
        path = _key(path)
        with _LOCK:
            _FILES.pop(path, None)
            for p in [p for p in _FILES if p.startswith(path + "/")]:
                del _FILES[p]
            for d in [d for d in _DIRS if d == path or d.startswith(path + "/")]:
                if d:
                    _DIRS.discard(d)
