"""A process the preemption tests signal from outside (tests/unit/test_preemption_review.py):
its launcher's own handler for the signal (a Python function, SIG_DFL or SIG_IGN), then a
CheckpointManager with preemption, training until it stops, and a report of what ran."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch

import bytecheckpoint as bcp


def main(root: str, mode: str, sig_name: str) -> None:
    sig = getattr(signal, sig_name)
    calls: list[dict[str, Any]] = []
    mgr: Any = None

    def launcher(signum: int, frame: Any) -> None:  # a launcher's: flush logs, tell the scheduler
        calls.append({"signum": signum, "flag_set_first": bool(mgr.agreement.flags[0])})

    signal.signal(sig, {"handler": launcher, "default": signal.SIG_DFL, "ignore": signal.SIG_IGN}[mode])
    before = signal.getsignal(sig)
    mgr = bcp.CheckpointManager(f"{root}/ckpt", preemption=True, check_every=2, async_save=False)
    state = {"w": torch.zeros(4)}
    step = 0
    for step in range(1, 3001):  # about 15 s: the test signals within the first steps
        state["w"] += 1
        mgr.save(step, state)
        if step == 1:
            open(f"{root}/ready", "w").close()
        if mgr.stop_requested:
            break
        time.sleep(0.005)
    mgr.close()
    report = {"stopped": mgr.stop_requested, "stopped_at": step, "latest": mgr.latest_step(),
              "calls": calls, "restored": signal.getsignal(sig) == before}
    with open(f"{root}/report.json.tmp", "w") as f:
        json.dump(report, f)
    os.replace(f"{root}/report.json.tmp", f"{root}/report.json")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
