"""A ``shm://`` save the shared-memory tests kill with SIGKILL, or keep alive, mid-save.

``python -m tests.support.shm_workers PATH MARKER``: saves to ``shm://PATH`` (under
``BCP_SHM_DIR``), stalls just before the commit renames its staging directory into place
(holding the path's save lock, the staging directory full), creates MARKER and sleeps until
killed.
"""

from __future__ import annotations

import os
import sys
import time


def stall_before_commit(path: str, marker: str) -> None:
    import torch

    import bytecheckpoint as bcp
    from bytecheckpoint.storage.shm import SharedMemoryStorage

    original = SharedMemoryStorage.rename

    def rename(self: SharedMemoryStorage, src: str, dst: str, *, overwrite: bool = False) -> None:
        if ".staging-" in src:
            open(marker, "w").close()
            time.sleep(600)
        original(self, src, dst, overwrite=overwrite)

    SharedMemoryStorage.rename = rename  # type: ignore[method-assign]
    bcp.save(f"shm://{path}", {"model": {"w": torch.arange(4096, dtype=torch.float32)}}, step=1)


if __name__ == "__main__":
    stall_before_commit(sys.argv[1], sys.argv[2])
    os._exit(3)  # never reached: the test kills us first
