"""Subprocesses for the tiering tests.

``python -m tests.support.tiering_worker move HOT COLD STEP`` runs one cooling pass and SIGKILLs
itself when the mover reaches STEP (see ``storage_tiering.mover``): copy, copied, verified,
remap, remapped, free.

``python -m tests.support.tiering_worker hold HOT COLD DIR`` runs one cooling pass (cool after 1 day,
keep the newest 1) that pauses after its first copy: it creates ``DIR/holding``, waits for
``DIR/release`` (60 s at most), goes on, and prints how many checkpoints it cooled and failed.

``python -m tests.support.tiering_worker load CKPT OUT`` loads a checkpoint into a plain model in one
process and writes the loaded state to OUT with torch.save.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import bytecheckpoint as bcp
from storage_tiering import load_config, run_once
from tests.support import workloads as w


def _move(hot: str, cold: str, step: str) -> None:
    def on_step(name: str) -> None:
        if name == step:
            os.kill(os.getpid(), signal.SIGKILL)

    run_once(load_config(hot=hot, cold=cold, cool_after=0, keep_newest=0), on_step=on_step)
    sys.exit("the move finished without reaching " + step)


def _hold(hot: str, cold: str, flags: str) -> None:
    def on_step(name: str) -> None:
        if name != "copied" or os.path.exists(f"{flags}/holding"):
            return
        open(f"{flags}/holding", "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{flags}/release") and time.monotonic() < deadline:
            time.sleep(0.02)

    config = load_config(env={}, hot=hot, cold=cold, cool_after="1d", keep_newest=1)
    report = run_once(config, on_step=on_step)
    print(f"cooled={len(report.cooled)} failed={len(report.failed)}")


def _load(ckpt: str, out: str) -> None:
    model, optim = w.make_plain(seed=99, lr=1e-4)
    bcp.load(ckpt, {"model": model, "optimizer": optim})
    torch.save(w.full_state(model, optim), out)


if __name__ == "__main__":
    if sys.argv[1] == "move":
        _move(*sys.argv[2:5])
    elif sys.argv[1] == "hold":
        _hold(*sys.argv[2:5])
    else:
        _load(*sys.argv[2:4])
