"""An overwrite never leaves its path without a checkpoint: on local disks and tmpfs the new
checkpoint and the old one are exchanged in one step (``renameat2``). Before, the old one was
renamed aside, then the new one renamed in, and between the two the path named nothing: a
crash there left it empty until the next save or load put the old one back, and a tool that
lists the directory (Lightning resolving ``ckpt_path="last"``) found no checkpoint and trained
from scratch. After every storage step of an overwrite, the path is checked."""

from __future__ import annotations

import os

import pytest

import bytecheckpoint as bcp
from bytecheckpoint.storage import register_backend
from bytecheckpoint.storage.local import LocalStorage
from bytecheckpoint.storage.shm import SharedMemoryStorage
from tests.support.commit_worker import make_state, values_of


def _watching(base: type, final_of: callable) -> type:
    class Watching(base):  # type: ignore[misc, valid-type]
        """After each rename or exchange, records whether the checkpoint path holds metadata."""

        seen: list[tuple[str, bool]] = []

        def _look(self, op: str) -> None:
            final = final_of()
            if final is not None:
                self.seen.append((op, os.path.exists(os.path.join(final, "metadata.msgpack"))))

        def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
            super().rename(src, dst, overwrite=overwrite)
            self._look("rename")

        def exchange(self, a: str, b: str) -> bool:
            swapped = super().exchange(a, b)
            self._look("exchange")
            return swapped

    return Watching


@pytest.mark.parametrize("scheme", ["file", "shm"])
def test_an_overwrite_path_always_names_a_checkpoint(tmp_path, monkeypatch, scheme):
    monkeypatch.setenv("BCP_SHM_DIR", str(tmp_path / "shm"))
    final: dict[str, str | None] = {"path": None}
    if scheme == "file":
        storage = _watching(LocalStorage, lambda: final["path"])
        register_backend("watchfile", lambda: storage(fsync=False), clobber=True)
        url, final_os = f"watchfile://{tmp_path}/run/ckpt", str(tmp_path / "run" / "ckpt")
    else:
        storage = _watching(SharedMemoryStorage, lambda: final["path"])
        register_backend("watchshm", lambda: storage(), clobber=True)
        url, final_os = "watchshm://run/ckpt", str(tmp_path / "shm" / "run" / "ckpt")
    bcp.save(url, make_state(1), step=1)
    final["path"] = final_os
    for value in (2, 3):
        storage.seen.clear()
        bcp.save(url, make_state(value), step=value, overwrite=True)
        assert ("exchange", True) in storage.seen
        assert all(present for _, present in storage.seen), storage.seen
        state = make_state(0)
        bcp.load(url, state)
        assert values_of(state) == {float(value)}
    leftovers = [n for n in os.listdir(os.path.dirname(final_os)) if n.startswith(".ckpt.")]
    assert not [n for n in leftovers if "replaced" in n or "staging" in n], leftovers
