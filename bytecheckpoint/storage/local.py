"""Local disk: positional reads and writes, fsync on commit, atomic renames."""

from __future__ import annotations

import os
import shutil

from .base import CommitMode, Storage, Writer


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalWriter(Writer):
    def __init__(self, path: str, fsync: bool) -> None:
        self._path = path
        self._fsync = fsync
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._size = 0

    def write(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        while mv:
            n = os.write(self._fd, mv)
            mv = mv[n:]
            self._size += n

    def commit(self) -> int:
        try:
            if self._fsync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
        return self._size

    def abort(self) -> None:
        try:
            os.close(self._fd)
        finally:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass


class LocalStorage(Storage):
    scheme = "file"
    commit_mode = CommitMode.RENAME

    def __init__(self, fsync: bool = True) -> None:
        # fsync is what makes a commit survive a power loss; tests may turn it off.
        self.fsync = fsync

    def open_writer(self, path: str) -> Writer:
        return _LocalWriter(path, self.fsync)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        mv = memoryview(buffer).cast("B")
        fd = os.open(path, os.O_RDONLY)
        try:
            total = 0
            while total < len(mv):
                n = os.preadv(fd, [mv[total:]], offset + total)
                if n == 0:
                    break
                total += n
            return total
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        st = os.stat(path)
        if not os.path.isfile(path):
            raise IsADirectoryError(path)
        return st.st_size

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        if overwrite and not os.path.isdir(dst):
            os.replace(src, dst)
        else:
            if os.path.lexists(dst):
                raise FileExistsError(dst)
            os.rename(src, dst)
        if self.fsync:
            _fsync_dir(os.path.dirname(os.path.abspath(dst)) or ".")

    def delete(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def url(self, path: str) -> str:
        return path
