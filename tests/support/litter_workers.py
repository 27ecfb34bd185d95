"""Processes the litter tests kill with SIGKILL at a chosen moment.

``python -m tests.support.litter_workers gc ROOT MARKER``: ``bcp gc ROOT --keep-last 1 --yes``
(without ``--cold``) that stalls right after renaming its first checkpoint aside.
``python -m tests.support.litter_workers latest ROOT MARKER``: a save of ``ROOT/step_1`` that
stalls after writing its ``.latest.tmp-*`` file, before renaming it over ``latest``.
Both create MARKER at the moment and sleep until killed.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def _stall(marker: str) -> None:
    open(marker, "w").close()
    time.sleep(600)


def gc(root: str, marker: str) -> None:
    from bytecheckpoint.cli import app as cli
    from bytecheckpoint.manage import deletion

    def stalled_delete_tree(*args: Any, **kwargs: Any) -> Any:
        _stall(marker)

    deletion.delete_tree = stalled_delete_tree  # called just after the rename aside
    cli.main(["gc", root, "--keep-last", "1", "--yes", "-q"])


def latest(root: str, marker: str) -> None:
    import torch

    import bytecheckpoint as bcp
    from bytecheckpoint.storage import register_backend
    from bytecheckpoint.storage.local import LocalStorage

    class Stalling(LocalStorage):
        scheme = "stall"

        def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
            if ".latest.tmp-" in src:
                _stall(marker)
            super().rename(src, dst, overwrite=overwrite)

    register_backend("stall", Stalling)
    bcp.save(f"stall://{root}/step_1", {"model": {"w": torch.arange(8.0)}}, step=1)


if __name__ == "__main__":
    {"gc": gc, "latest": latest}[sys.argv[1]](sys.argv[2], sys.argv[3])
    os._exit(3)  # never reached: the test kills us first
