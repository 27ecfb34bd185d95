"""A single-process trainer for the commit-safety tests, run as a subprocess.

    python -m tests.support.commit_worker stall PATH VALUE      save; stall in the first data write
                                                        until PATH.go exists (PATH.stalled says
                                                        it is there), then finish
    python -m tests.support.commit_worker crash MOMENT PATH VALUE
                                                        overwrite PATH and die (SIGKILL) at MOMENT:
                                                        write (mid data file), aside (old moved
                                                        aside, new not yet in), swapped (new in,
                                                        old not yet deleted)
    python -m tests.support.commit_worker loop PATH SECONDS     overwrite PATH with values 1, 2, 1, 2 ...

The last line printed is JSON: {"ok": true} or {"error": [type, message]}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import bytecheckpoint as bcp
from bytecheckpoint.storage import register_backend
from bytecheckpoint.storage.local import LocalStorage

SHAPE = (256, 256)  # 256 KiB per tensor: reads take long enough for a swap to land mid-load


def make_state(value: int) -> dict:
    """Every element of every part carries ``value``, so a load mixing two saves shows."""
    model = torch.nn.Linear(*SHAPE)
    with torch.no_grad():
        model.weight.fill_(float(value))
        model.bias.fill_(float(value))
    ema = torch.nn.Linear(*SHAPE)
    with torch.no_grad():
        ema.weight.fill_(float(value))
        ema.bias.fill_(float(value))
    return {"model": model, "ema": ema, "extra_state": {"value": value}}


def values_of(state: dict) -> set:
    """The values a loaded state holds: one element for a whole save, more for a mixture."""
    found = set()
    for key in ("model", "ema"):
        for t in state[key].state_dict().values():
            found.update(torch.unique(t).tolist())
    found.add(float(state["extra_state"].get("value", -1)))
    return found


class StallingStorage(LocalStorage):
    scheme = "stall"

    def __init__(self, path: str) -> None:
        super().__init__(fsync=False)
        self.path, self.stalled = path, False

    def open_writer(self, path: str):
        writer = super().open_writer(path)
        if path.endswith(".safetensors") and not self.stalled:
            self.stalled = True
            original = writer.write

            def write(data):
                original(bytes(memoryview(data)[: max(1, len(data) // 2)]))
                open(self.path + ".stalled", "w").close()
                deadline = time.time() + 120
                while not os.path.exists(self.path + ".go") and time.time() < deadline:
                    time.sleep(0.02)
                original(bytes(memoryview(data)[max(1, len(data) // 2):]))

            writer.write = write
        return writer


class CrashingStorage(LocalStorage):
    scheme = "crash"

    def __init__(self, moment: str) -> None:
        super().__init__(fsync=False)
        # "two-step:<moment>": a file system without renameat2's exchange (the commit renames
        # the old checkpoint aside, then the new one in)
        self.two_step = moment.startswith("two-step:")
        self.moment = moment.removeprefix("two-step:")

    def exchange(self, a: str, b: str) -> bool:
        if self.two_step:
            return False
        swapped = super().exchange(a, b)
        if swapped and self.moment == "exchanged":
            self._die()
        return swapped

    def _die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def open_writer(self, path: str):
        writer = super().open_writer(path)
        if self.moment == "write" and path.endswith(".safetensors"):
            original = writer.write

            def write(data):
                original(bytes(memoryview(data)[: max(1, len(data) // 2)]))
                self._die()

            writer.write = write
        return writer

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        super().rename(src, dst, overwrite=overwrite)
        if self.moment == "aside" and ".replaced-" in dst:
            self._die()
        if self.moment == "swapped" and ".staging-" in src:
            self._die()


def main() -> None:
    torch.set_num_threads(1)
    mode = sys.argv[1]
    result: dict = {"ok": True}
    try:
        if mode == "stall":
            path, value = sys.argv[2], int(sys.argv[3])
            register_backend("stall", lambda: StallingStorage(path))
            bcp.save(f"stall://{path}", make_state(value), step=value)
        elif mode == "crash":
            moment, path, value = sys.argv[2], sys.argv[3], int(sys.argv[4])
            register_backend("crash", lambda: CrashingStorage(moment))
            bcp.save(f"crash://{path}", make_state(value), step=value, overwrite=True)
        elif mode == "loop":
            path, seconds = sys.argv[2], float(sys.argv[3])
            states = [make_state(1), make_state(2)]
            deadline, n = time.time() + seconds, 0
            while time.time() < deadline:
                bcp.save(path, states[n % 2], step=n % 2 + 1, overwrite=True)
                n += 1
            result["saves"] = n
    except Exception as exc:
        print(json.dumps({"error": [type(exc).__name__, str(exc)]}))
        sys.exit(1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
