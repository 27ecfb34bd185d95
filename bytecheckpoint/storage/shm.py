"""Shared memory (``shm://name/...``): the in-memory flavour that every process on a host sees.

``mem://`` lives inside one process. A multi-process job that checkpoints to memory needs a
namespace its ranks share, so ``shm://`` maps paths onto a directory in the host's
shared-memory file system (tmpfs, ``/dev/shm``; override with ``BCP_SHM_DIR``). The data
lives in RAM and survives the death of a rank, but not a reboot; there is nothing to fsync.
"""

from __future__ import annotations

import os

from ..errors import StorageError
from .base import CommitMode
from .local import LocalStorage

DEFAULT_DIR = "/dev/shm/bytecheckpoint"


class SharedMemoryStorage(LocalStorage):
    scheme = "shm"
    commit_mode = CommitMode.RENAME
    page_cache_is_copy = False  # tmpfs: the cached pages are the only copy

    def __init__(self, root: str | None = None) -> None:
        super().__init__(fsync=False)
        self.root = os.path.abspath(root or os.environ.get("BCP_SHM_DIR") or DEFAULT_DIR)

    def _os_path(self, path: str) -> str:
        full = os.path.normpath(os.path.join(self.root, path.lstrip("/")))
        if full != self.root and not full.startswith(self.root + os.sep):
            raise StorageError(f"shm://{path} points outside the shared-memory root {self.root}")
        return full

    def makedirs(self, path: str) -> None:
        os.makedirs(self.root, exist_ok=True)
        super().makedirs(path)

    def url(self, path: str) -> str:
        return f"shm://{path.lstrip('/')}"
