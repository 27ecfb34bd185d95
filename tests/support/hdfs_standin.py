"""An in-memory stand-in for ``hdfs_native.Client``, with the same methods and error types.

It keeps a tree of directories and files and enforces what the HDFS name node enforces
and the backend relies on: ``create`` needs the parent unless ``create_parent``; ``rename``
refuses an existing target unless ``overwrite`` and is atomic; ``delete`` of a non-empty
directory needs ``recursive``. It can fail chosen calls with the kinds of errors the real
client raises (``FileNotFoundError``, ``PermissionError``, I/O errors).
"""

from __future__ import annotations

import posixpath
import threading
from dataclasses import dataclass


@dataclass
class Status:
    path: str
    length: int
    isdir: bool


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data = data

    def __len__(self) -> int:
        return len(self._data)

    def read_range(self, offset: int, length: int) -> bytes:
        return self._data[offset : offset + length]

    def close(self) -> None:
        pass


class _Writer:
    def __init__(self, client: StandInClient, path: str) -> None:
        self._client, self._path, self._parts = client, path, []

    def write(self, buf) -> int:
        self._client._maybe_fail("write", self._path)
        self._parts.append(bytes(buf))
        return len(buf)

    def close(self) -> None:
        self._client._maybe_fail("close", self._path)
        with self._client.lock:
            self._client.files[self._path] = b"".join(self._parts)


class StandInClient:
    def __init__(self, url: str | None = None) -> None:
        self.url = url
        self.lock = threading.RLock()
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {"/"}
        self.calls: list[tuple[str, str]] = []
        self.failures: dict[str, list[BaseException]] = {}  # method -> errors to raise, in order

    def _maybe_fail(self, method: str, path: str) -> None:
        with self.lock:
            self.calls.append((method, path))
            queue = self.failures.get(method)
            if queue:
                raise queue.pop(0)

    def _missing(self, path: str) -> FileNotFoundError:
        return FileNotFoundError(f"File does not exist: {path}")

    def get_file_info(self, path: str) -> Status:
        self._maybe_fail("get_file_info", path)
        with self.lock:
            if path in self.files:
                return Status(path, len(self.files[path]), False)
            if path in self.dirs:
                return Status(path, 0, True)
        raise self._missing(path)

    def list_status(self, path: str, recursive: bool = False):
        self._maybe_fail("list_status", path)
        with self.lock:
            if path not in self.dirs:
                raise self._missing(path)
            prefix = path.rstrip("/") + "/"
            children = {p for p in (*self.files, *self.dirs) if p.startswith(prefix) and p != path
                        and "/" not in p[len(prefix):]}
            return iter([Status(p, len(self.files.get(p, b"")), p in self.dirs) for p in sorted(children)])

    def read(self, path: str) -> _Reader:
        self._maybe_fail("read", path)
        with self.lock:
            if path not in self.files:
                raise self._missing(path)
            return _Reader(self.files[path])

    def create(self, path: str, write_options) -> _Writer:
        self._maybe_fail("create", path)
        parent = posixpath.dirname(path)
        with self.lock:
            if parent not in self.dirs:
                if not write_options.create_parent:
                    raise self._missing(parent)
                self.mkdirs(parent, create_parent=True)
            if path in self.files and not write_options.overwrite:
                raise FileExistsError(path)
        return _Writer(self, path)

    def mkdirs(self, path: str, permission: int = 0o755, create_parent: bool = False) -> None:
        self._maybe_fail("mkdirs", path)
        with self.lock:
            while path not in self.dirs:
                if not create_parent and posixpath.dirname(path) not in self.dirs:
                    raise self._missing(posixpath.dirname(path))
                self.dirs.add(path)
                path = posixpath.dirname(path)

    def rename(self, src: str, dst: str, overwrite: bool = False) -> None:
        self._maybe_fail("rename", src)
        with self.lock:
            if src not in self.files and src not in self.dirs:
                raise self._missing(src)
            if dst in self.dirs or (dst in self.files and not overwrite):
                raise FileExistsError(dst)
            if src in self.files:
                self.files[dst] = self.files.pop(src)
                return
            for p in [p for p in self.files if p.startswith(src + "/")]:
                self.files[dst + p[len(src):]] = self.files.pop(p)
            for d in [d for d in self.dirs if d == src or d.startswith(src + "/")]:
                self.dirs.discard(d)
                self.dirs.add(dst + d[len(src):])

    def delete(self, path: str, recursive: bool = False) -> bool:
        self._maybe_fail("delete", path)
        with self.lock:
            inside = [p for p in (*self.files, *self.dirs) if p.startswith(path + "/")]
            if inside and not recursive:
                raise OSError(f"{path} is non empty': Directory is not empty")
            found = path in self.files or path in self.dirs
            for p in inside + [path]:
                self.files.pop(p, None)
                self.dirs.discard(p)
            return found
