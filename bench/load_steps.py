"""When each step of a cold load happens, and what a change to the read path is worth, with
the variants of the load alternating in one run (the disk here drifts between runs by more
than most changes are worth).

    .venv/bin/python bench/load_steps.py --model 1.3gb --reps 8 --modes base,no-hash,no-verify
    .venv/bin/python bench/load_steps.py --model 3.56gb --reps 6 --modes run=256,run=64,run=32

4 FSDP2 ranks (GPT + AdamW, gloo) save one checkpoint, then load it ``--reps`` times per mode
into the same layout, modes in rotation, the page cache dropped before each load:

  base        ``bcp.load`` as it is
  no-hash     the checksums' hash left out (``bad_chunks`` finds nothing): what hashing costs
  no-verify   ``bcp.load(..., verify=False)``: no checksums and no header check
  run=N       early reads in requests of up to N MiB (``Prefetch(run_bytes=...)``)

Prints per mode the median and every load's seconds (slowest rank), and for the first mode
when each step began and ended on each rank (medians, seconds from the load's start).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MODELS, free_port, gather  # noqa: E402
from bench.load_vs_read_limit import data_files, drop_cache, saved_state  # noqa: E402


class Steps:
    """The first time each marked event happened in one load (from its start)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []
        self._lock = threading.Lock()

    def mark(self, name: str) -> None:
        with self._lock:
            self.events.append((name, time.perf_counter()))

    def wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.mark(f"{name} begins")
            try:
                return original(*args, **kwargs)
            finally:
                self.mark(f"{name} ends")

        setattr(owner, name, timed)

    def since(self, t0: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, t in self.events:
            if name == "last read ends":
                out[name] = t - t0
            else:
                out.setdefault(name, t - t0)
        return out


def worker(rank: int, world: int, port: int, model: str, reps: int, modes: list[str], path: str,
           out: str) -> None:
    import bytecheckpoint as bcp
    from bytecheckpoint.engine import load as load_mod
    from bytecheckpoint.engine import load_pipeline
    from bytecheckpoint.runtime.comm import Communicator

    state = saved_state(rank, world, port, model, path)
    steps = Steps()
    for owner, name in [(load_mod, "_open_checkpoint"), (load_mod, "flatten_state"),
                        (load_mod, "_plan_local"), (load_mod, "_prefetch"), (Communicator, "all_gather"),
                        (load_mod, "plan_reads"),
                        (load_pipeline.LoadPipeline, "run"), (Communicator, "check_all")]:
        steps.wrap(owner, name)
    preadv = os.preadv

    def timed_preadv(fd: int, buffers: list, offset: int, *rest: Any) -> int:
        big = sum(len(b) for b in buffers) >= 1 << 20
        if big:
            steps.mark("first read (>= 1 MiB) begins")
        try:
            return preadv(fd, buffers, offset, *rest)
        finally:
            if big:
                steps.mark("last read ends")

    os.preadv = timed_preadv
    hashing = load_pipeline.bad_chunks
    files = [f for f, _ in data_files(path)]
    results: list[dict[str, Any]] = []
    kwdefaults = dict(load_pipeline.Prefetch.__init__.__kwdefaults__)
    try:
        for i in range(reps * len(modes)):
            mode = modes[i % len(modes)]
            load_pipeline.bad_chunks = (lambda *a, **k: []) if mode == "no-hash" else hashing
            run = int(mode.split("=", 1)[1]) << 20 if mode.startswith("run=") else kwdefaults["run_bytes"]
            load_pipeline.Prefetch.__init__.__kwdefaults__["run_bytes"] = run
            dist.barrier()
            if rank == 0:
                drop_cache(files)
            dist.barrier()
            steps.events.clear()
            t0 = time.perf_counter()
            bcp.load(path, state, framework="fsdp2", verify=mode != "no-verify")
            took = time.perf_counter() - t0
            results.append({"mode": mode, "s": took, "steps": steps.since(t0)})
    finally:
        os.preadv, load_pipeline.bad_chunks = preadv, hashing
        load_pipeline.Prefetch.__init__.__kwdefaults__.update(kwdefaults)
    everyone = gather(results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    dist.barrier()
    os._exit(0)


def report(everyone: list[list[dict[str, Any]]], modes: list[str]) -> list[str]:
    lines = []
    for mode in modes:
        loads = [max(r[i]["s"] for r in everyone) for i in range(len(everyone[0]))
                 if everyone[0][i]["mode"] == mode]
        lines.append(f"  {mode:12s} median {statistics.median(loads):.3f} s   "
                     f"(each: {' '.join(f'{s:.3f}' for s in loads)})")
    first = [[rep for rep in r if rep["mode"] == modes[0]] for r in everyone]
    names = {n for r in first for rep in r for n in rep["steps"]}
    order = sorted(names, key=lambda n: statistics.median(rep["steps"].get(n, 99) for rep in first[0]))
    lines.append(f"  steps of {modes[0]!r}, medians, s from the load's start:")
    for n in order:
        per_rank = [statistics.median(rep["steps"][n] for rep in r if n in rep["steps"]) for r in first]
        lines.append(f"    {n:32s} " + "  ".join(f"rank {k}: {t:.3f}" for k, t in enumerate(per_rank)))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3gb")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--modes", default="base,no-hash,no-verify")
    parser.add_argument("--dir", default=None, help="where the checkpoint goes (default: a temporary one)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("base", "no-hash", "no-verify") and not (m.startswith("run=") and m[4:].isdigit()):
            parser.error(f"unknown mode {m!r}: base, no-hash, no-verify or run=MiB")
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        out = os.path.join(root, "steps.json")
        mp.spawn(worker, args=(4, free_port(), args.model, args.reps, modes, os.path.join(root, "ckpt"), out),
                 nprocs=4)
        with open(out) as f:
            everyone = json.load(f)
        print(f"{args.model}: cold loads 4 -> 4, {args.reps} per mode, alternating")
        print("\n".join(report(everyone, modes)))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
