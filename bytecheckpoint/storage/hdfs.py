"""HDFS (``hdfs://namenode:port/path``) through ``hdfs-native``, a JVM-free HDFS client.

Implemented against the client's documented interface, not tested against a cluster (no
HDFS can run on the machines this project is built on; see tests/unit/test_storage_hdfs.py for
what the tests do and do not prove).

- Commits by rename (``CommitMode.RENAME``): an HDFS rename is atomic on the name node.
- Reads: a large range is split into parts read concurrently, each with its own reader.
- Writes stream through one HDFS writer per file, which pipelines packets to the datanodes.
  Neither Python HDFS client exposes the name node's ``concat``, so a file is not written
  as concurrent parts joined afterwards; parallelism comes from the rank's several files.
- Errors the client gives up on are retried here when they are transient. hdfs-native
  itself keeps retrying an unreachable name node for minutes before it reports anything
  (it reads no Hadoop key that shortens this), so a dead cluster shows as a slow failure.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import PermanentStorageError, StorageError, TransientStorageError
from . import parallel
from .base import CommitMode, Storage, Writer
from .config import HdfsSettings, TransferSettings, settings


def _client_factory() -> Callable[[str | None], Any]:
    from hdfs_native import Client

    return lambda url: Client(url)


@contextlib.contextmanager
def _errors(what: str) -> Iterator[None]:
    """Keep the answers (not found, exists, permission) and mark the rest transient."""
    try:
        yield
    except (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError):
        raise
    except PermissionError as exc:
        raise PermanentStorageError(
            f"{what}: permission denied ({exc}); grant this user write access to the directory "
            "or use another path"
        ) from exc
    except (OSError, RuntimeError) as exc:
        raise TransientStorageError(f"{what}: {exc}") from exc


class _HdfsWriter(Writer):
    def __init__(self, storage: HdfsStorage, path: str) -> None:
        self._storage, self._path = storage, path
        client, self._hpath = storage._resolve(path)
        with _errors(f"create {storage.url(path)}"):
            self._stream = client.create(self._hpath, storage._write_options())
        self._size = 0
        self._broken: str | None = None

    def write(self, data: memoryview | bytes) -> None:
        if self._broken:
            raise PermanentStorageError(
                f"{self._storage.url(self._path)}: an earlier write failed after the HDFS client's own "
                f"pipeline recovery ({self._broken}); this file cannot be completed: write it again"
            )
        mv = memoryview(data).cast("B")
        try:
            with _errors(f"write {self._storage.url(self._path)}"):
                self._stream.write(mv)
        except StorageError as exc:
            # Part of the buffer may be in the file already: the call cannot be repeated.
            self._broken = str(exc)
            raise PermanentStorageError(f"{exc}; the stream is broken, so this file cannot be completed: "
                                        "write it again") from exc
        self._size += len(mv)

    def commit(self) -> int:
        with _errors(f"close {self._storage.url(self._path)}"):
            self._stream.close()
        return self._size

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()
        with contextlib.suppress(Exception):
            self._storage.delete(self._path)


class HdfsStorage(Storage):
    scheme = "hdfs"
    commit_mode = CommitMode.RENAME

    def __init__(self, hdfs: HdfsSettings | None = None, transfer: TransferSettings | None = None,
                 client_factory: Callable[[str | None], Any] | None = None) -> None:
        conf = settings()
        self.hdfs = hdfs or conf.hdfs
        self.transfer = transfer or conf.transfer
        self._factory = client_factory or _client_factory()
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    # Paths are "<authority>/<absolute path>", as split_url leaves them: "nn:8020/user/x".
    def _resolve(self, path: str) -> tuple[Any, str]:
        authority, _, rest = path.partition("/")
        hpath = posixpath.normpath("/" + rest)
        with self._lock:
            client = self._clients.get(authority)
            if client is None:
                url = f"hdfs://{authority}" if authority else self.hdfs.url
                with _errors(f"connect to {url or 'the default name node (fs.defaultFS)'}"):
                    client = self._clients[authority] = self._factory(url)
        return client, hpath

    def _write_options(self) -> Any:
        from hdfs_native import WriteOptions

        return WriteOptions(overwrite=True, create_parent=True)

    def open_writer(self, path: str) -> Writer:
        return _HdfsWriter(self, path)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        client, hpath = self._resolve(path)
        what = f"read {self.url(path)}"

        def read_part(off: int, view: memoryview) -> int:
            with _errors(what), contextlib.closing(client.read(hpath)) as reader:
                data = reader.read_range(off, min(len(view), max(0, len(reader) - off)))
            view[: len(data)] = data
            return len(data)

        return parallel.read_parts(read_part, offset, buffer, self.transfer)

    def _status(self, path: str) -> Any:
        client, hpath = self._resolve(path)
        with _errors(f"stat {self.url(path)}"):
            return client.get_file_info(hpath)

    def size(self, path: str) -> int:
        status = self._status(path)
        if status.isdir:
            raise IsADirectoryError(self.url(path))
        return status.length

    def list_dir(self, path: str) -> list[str]:
        client, hpath = self._resolve(path)
        try:
            with _errors(f"list {self.url(path)}"):
                return sorted(os.path.basename(s.path.rstrip("/")) for s in client.list_status(hpath))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def is_dir(self, path: str) -> bool:
        try:
            return bool(self._status(path).isdir)
        except FileNotFoundError:
            return False

    def makedirs(self, path: str) -> None:
        client, hpath = self._resolve(path)
        with _errors(f"mkdir {self.url(path)}"):
            client.mkdirs(hpath, create_parent=True)

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        client, hsrc = self._resolve(src)
        _, hdst = self._resolve(dst)
        if overwrite and self.is_dir(dst):
            raise IsADirectoryError(self.url(dst))
        with _errors(f"rename {self.url(src)}"):
            client.rename(hsrc, hdst, overwrite)

    def delete(self, path: str) -> None:
        client, hpath = self._resolve(path)
        with contextlib.suppress(FileNotFoundError), _errors(f"delete {self.url(path)}"):
            client.delete(hpath, True)

    def url(self, path: str) -> str:
        return f"hdfs://{path}"
