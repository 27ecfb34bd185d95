"""How long ``save(async_save=True)`` holds the caller on a plan-cache hit, and its CPU.

    .venv/bin/python bench/save_return.py                       # 3.56 GB model, ~2 min
    .venv/bin/python bench/save_return.py --model 1.3gb --saves 12 --snapshot blocking

FSDP2 (GPT + AdamW, the models of bench/common.py) on 4 CPU processes (gloo). Two untimed
saves warm the arena and the plan cache; then ``--saves`` times: a barrier, the timed
``bcp.save`` (every rank at once, as in training), its ``wait()``, and the checkpoint is
removed. Prints, medians over the saves: the return (max over ranks, per save), the CPU
time of the calling thread (``time.thread_time``, median over ranks too) and, for
``--snapshot overlapped``, how long the copy ran after the return. With no training
running, the return here is the save's own work on 4 processes sharing the cores; in
bench/train_loop_cost.py the same call meets training processes too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.common import MODELS, free_port, gather  # noqa: E402
from bench.load_vs_read_limit import make_state  # noqa: E402


def worker(rank: int, world: int, port: int, model: str, saves: int, snapshot: str, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    import bytecheckpoint as bcp

    state = make_state(MODELS[model], 0)
    kwargs: dict[str, Any] = {"framework": "fsdp2", "async_save": True, "snapshot": snapshot}
    for k in range(2):
        bcp.save(f"{root}/warm{k}", state, **kwargs).wait()
    returns, cpus, copies = [], [], []
    for k in range(saves):
        dist.barrier()
        c, t = time.thread_time(), time.perf_counter()
        handle = bcp.save(f"{root}/s{k}", state, **kwargs)
        returns.append(time.perf_counter() - t)
        cpus.append(time.thread_time() - c)
        handle.wait_snapshot()
        copies.append(time.perf_counter() - t - returns[-1])
        handle.wait()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(f"{root}/s{k}", ignore_errors=True)
    everyone = gather((returns, cpus, copies))
    if rank == 0:
        ret = [max(r[0][k] for r in everyone) for k in range(saves)]
        cpu = [c for r in everyone for c in r[1]]
        copy = [max(r[2][k] for r in everyone) for k in range(saves)]
        print(f"{model}, snapshot={snapshot}, {saves} hit saves on {world} ranks "
              f"(load average {open('/proc/loadavg').read().split()[0]}):")
        print(f"  return, max over ranks: median {1e3 * statistics.median(ret):.1f} ms "
              f"(each: {' '.join(f'{1e3 * x:.0f}' for x in ret)})")
        print(f"  caller thread CPU per save: median {1e3 * statistics.median(cpu):.1f} ms")
        if snapshot == "overlapped":
            print(f"  copy after the return, max over ranks: median {statistics.median(copy):.3f} s")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="3.56gb", choices=sorted(MODELS))
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--snapshot", default="overlapped", choices=["overlapped", "blocking"])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "bcp-bench-return"))
    args = parser.parse_args()
    root = os.path.abspath(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    try:
        mp.start_processes(worker, nprocs=4, start_method="spawn",
                           args=(4, free_port(), args.model, args.saves, args.snapshot, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
