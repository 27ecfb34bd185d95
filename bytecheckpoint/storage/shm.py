"""Shared memory (``shm://name/...``): the in-memory flavour that every process on a host sees.

``mem://`` lives inside one process. A multi-process job that checkpoints to memory needs a
namespace its ranks share, so ``shm://`` maps paths onto a directory in the host's
shared-memory file system (tmpfs, ``/dev/shm``; override with ``BCP_SHM_DIR``). The data
lives in RAM and survives the death of a rank, but not a reboot; there is nothing to fsync.

Nothing is ever read, written or deleted outside that directory: ``..`` segments and symbolic
links inside it that resolve outside it are refused by name.
"""

from __future__ import annotations

import os

from ..errors import InvalidStorageURLError
from .base import CommitMode
from .local import LocalStorage

DEFAULT_DIR = "/dev/shm/bytecheckpoint"


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class SharedMemoryStorage(LocalStorage):
    scheme = "shm"
    commit_mode = CommitMode.RENAME
    page_cache_is_copy = False  # tmpfs: the cached pages are the only copy

    def __init__(self, root: str | None = None) -> None:
        super().__init__(fsync=False)
        self.configured = root or os.environ.get("BCP_SHM_DIR") or DEFAULT_DIR
        self.root = os.path.abspath(self.configured)

    def check_path(self, path: str) -> None:
        # Every process of the host must map shm:// onto the same directory: a relative one
        # would depend on each process's working directory.
        if not os.path.isabs(self.configured):
            raise InvalidStorageURLError(
                f"BCP_SHM_DIR={self.configured!r} is a relative path; give an absolute directory "
                f"such as {DEFAULT_DIR}")
        if not os.path.isdir(self.root):
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as exc:
                raise InvalidStorageURLError(
                    f"the shared-memory root {self.root} (BCP_SHM_DIR) is not a directory and cannot "
                    f"be made one ({exc.strerror or exc}); set BCP_SHM_DIR to a writable directory "
                    f"on tmpfs, such as {DEFAULT_DIR}") from None
        self._os_path(path)

    def _os_path(self, path: str, *, follow_last: bool = True) -> str:
        full = os.path.normpath(os.path.join(self.root, path.lstrip("/")))
        if not _inside(full, self.root):
            raise InvalidStorageURLError(f"shm://{path} points outside the shared-memory root {self.root}")
        # A symbolic link inside the root may lead anywhere: where it resolves must be inside
        # the root too, so nothing outside it is written through it or deleted through it.
        # (``follow_last=False``: the entry itself is acted on, never what a link there names.)
        resolved = full if follow_last or full == self.root else os.path.dirname(full)
        if not _inside(os.path.realpath(resolved), os.path.realpath(self.root)):
            raise InvalidStorageURLError(
                f"shm://{path} leads outside the shared-memory root {self.root} through a symbolic "
                "link; remove the link (nothing was read or written through it)")
        return full

    def makedirs(self, path: str) -> None:
        os.makedirs(self.root, exist_ok=True)
        super().makedirs(path)

    def delete(self, path: str) -> None:
        full = self._os_path(path, follow_last=False)
        if os.path.islink(full):
            os.unlink(full)  # the link itself, never what it points to
            return
        super().delete(path)

    def url(self, path: str) -> str:
        return f"shm://{path.lstrip('/')}"
