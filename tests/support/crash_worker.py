"""A rank of a 2-process job that gets killed in the middle of its second save.

Run as ``python -m tests.support.crash_worker ROOT MOMENT`` with RANK/WORLD_SIZE/MASTER_PORT set.
Saves step_1 normally (and a torch.save reference of its full state), then saves step_2
through a storage backend that stalls at MOMENT so the test can SIGKILL the process there:
  write   rank 1 stalls in the middle of writing its first storage file
  async   the same, in the background of an async save, while the training thread goes on
  commit  rank 0 stalls after writing the metadata, just before the commit rename
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from bytecheckpoint.storage import register_backend
from bytecheckpoint.storage.local import LocalStorage
from tests.support import workloads as w


class StallingStorage(LocalStorage):
    scheme = "stall"

    def __init__(self, moment: str, marker: str) -> None:
        super().__init__()
        self.moment, self.marker = moment, marker

    def _stall(self) -> None:
        open(self.marker, "w").close()
        time.sleep(600)

    def open_writer(self, path: str):
        writer = super().open_writer(path)
        if self.moment in ("write", "async") and dist.get_rank() == 1 and path.endswith(".safetensors"):
            original = writer.write

            def write(data):
                original(bytes(memoryview(data)[: max(1, len(data) // 2)]))
                self._stall()

            writer.write = write
        return writer

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        if self.moment == "commit" and ".staging-" in src:
            self._stall()
        super().rename(src, dst, overwrite=overwrite)


def main() -> None:
    root, moment = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    model, optim = w.make_fsdp2(seed=0)
    w.train_step(model, optim, 0, dist.get_rank())
    bcp.save(f"{root}/step_1", {"model": model, "optimizer": optim}, step=1)
    ref = w.full_state(model, optim)
    if dist.get_rank() == 0:
        torch.save({k: v for k, v in ref.items() if isinstance(v, torch.Tensor)}, f"{root}/ref.pt")
    dist.barrier()
    w.train_step(model, optim, 1, dist.get_rank())
    marker = f"{root}/stalled-{moment}"
    register_backend("stall", lambda: StallingStorage(moment, marker))
    if moment == "async":
        handle = bcp.save(f"stall://{root}/step_2", {"model": model, "optimizer": optim}, step=2,
                          async_save=True)
        w.train_step(model, optim, 2, dist.get_rank())  # training goes on meanwhile
        handle.wait()
    else:
        bcp.save(f"stall://{root}/step_2", {"model": model, "optimizer": optim}, step=2)
    os._exit(3)  # never reached: the test kills us first


if __name__ == "__main__":
    main()
