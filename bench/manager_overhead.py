"""Per-step cost of the CheckpointManager when no save is due and no signal comes.

Usage: python bench/manager_overhead.py [--world 2] [--steps 400] [--repeats 5] [--check-every 8]

On ``--world`` gloo ranks (CPU), a small FSDP2 training step (the tests' 2-layer GPT) runs
``--steps`` times plain, then the same with ``mgr.save(step, state)`` after every step (a
manager with preemption handlers and no step schedule, so it never saves: what remains is the
local flag check and, every ``--check-every`` steps, starting one tiny non-blocking all-reduce
and collecting the previous one). Blocks alternate plain / managed ``--repeats`` times; the
medians per step are printed, with the overhead as a share of the plain step and the cost of
the manager call alone (timed around it, in microseconds).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, root: str, out: object) -> None:
    import torch
    import torch.distributed as dist

    import bytecheckpoint as bcp
    from tests.support.workloads import make_fsdp2, train_step

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    model, optim = make_fsdp2(seed=0)
    state = {"model": model, "optimizer": optim}
    mgr = bcp.CheckpointManager(root, preemption=True, check_every=args.check_every)
    plain, managed, calls, checks, others = [], [], [], [], []
    step = 0
    for _ in range(args.repeats):
        for managed_block in (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            call_s = 0.0
            for _ in range(args.steps):
                step += 1
                train_step(model, optim, step, rank)
                if managed_block:
                    c0 = time.perf_counter()
                    mgr.save(step, state)
                    took = time.perf_counter() - c0
                    call_s += took
                    (checks if step % args.check_every == 0 else others).append(took)
            per_step = (time.perf_counter() - t0) / args.steps
            (managed if managed_block else plain).append(per_step)
            if managed_block:
                calls.append(call_s / args.steps)
    mgr.close()
    if rank == 0:
        out.put((plain, managed, calls, checks, others))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-every", type=int, default=8)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    root = tempfile.mkdtemp(prefix="bcp-manager-bench-")
    mp.spawn(_rank, args=(args.world, _port(), args, root, out), nprocs=args.world, join=True)
    plain, managed, calls, checks, others = out.get()
    p, m, c = statistics.median(plain), statistics.median(managed), statistics.median(calls)
    print(f"world {args.world}, {args.steps} steps x {args.repeats} blocks, "
          f"check every {args.check_every} steps")
    print(f"plain step          {p * 1e3:8.3f} ms")
    print(f"step + mgr.save()   {m * 1e3:8.3f} ms  ({(m - p) / p * 100:+.2f} % wall, noisy)")
    print(f"mgr.save() alone    {c * 1e6:8.1f} us  ({c / p * 100:.3f} % of the plain step), of which:")
    print(f"  a step without a check {statistics.median(others) * 1e6:8.1f} us (median)")
    print(f"  a check step           {statistics.median(checks) * 1e6:8.1f} us (median), "
          f"{statistics.fmean(checks) * 1e6:.1f} us (mean)")


if __name__ == "__main__":
    main()
