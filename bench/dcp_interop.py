"""Loading a PyTorch DCP checkpoint: bytecheckpoint (``bcp.load`` of the directory as it is)
against ``torch.distributed.checkpoint.load``, on the same layout.

    .venv/bin/python bench/dcp_interop.py [--ranks 2] [--reps 3] [--small] [--dir DIR]

Workload: a GPT-style model with AdamW state (about 30M parameters, ``--small`` about 7M),
FSDP2 over ``--ranks`` CPU processes (gloo), trained one step and saved by ``dcp.save`` of
``get_state_dict``. Each repetition loads that directory into a fresh FSDP2 model + optimizer
of the same layout, once with each system (the order alternates); page caches are dropped
before every load when /proc/sys/vm/drop_caches is writable. Prints the medians and their
ratio (bcp.load / dcp.load: below 1 means bytecheckpoint is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import drop_caches, make_fsdp  # noqa: E402
from demo.model import GPTConfig, batch, loss_fn  # noqa: E402

MEDIUM = GPTConfig(vocab_size=16003, context=32, dim=512, heads=8, layers=8, mlp_ratio=3)
SMALL = GPTConfig(vocab_size=8003, context=32, dim=256, heads=4, layers=4, mlp_ratio=3)


def _rank(rank: int, world: int, port: int, cfg: GPTConfig, path: str, reps: int, out: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import bytecheckpoint as bcp
    from bytecheckpoint.state.flatten import init_optimizer_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    model, optim = make_fsdp(cfg, 0, lr=1e-3)
    inputs, targets = batch(cfg, 0, rank)
    loss_fn(model, inputs, targets).backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)
    del model, optim, msd, osd

    def with_dcp() -> None:
        m, o = make_fsdp(cfg, 1, lr=1e-3)
        init_optimizer_state(o)  # dcp.load fills existing state, as bcp.load does
        msd, osd = get_state_dict(m, o)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def with_bcp() -> None:
        m, o = make_fsdp(cfg, 1, lr=1e-3)
        bcp.load(path, {"model": m, "optimizer": o})

    times: dict[str, list[float]] = {"dcp.load": [], "bcp.load": []}
    dropped = False
    for rep in range(reps):
        order = [("dcp.load", with_dcp), ("bcp.load", with_bcp)]
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            dist.barrier()
            if rank == 0:
                dropped = drop_caches()
            dist.barrier()
            t = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t)
    if rank == 0:
        out.update({k: v for k, v in times.items()}, dropped=dropped)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    cfg = SMALL if args.small else MEDIUM
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, mp.Manager() as manager:
        out = manager.dict()
        path = os.path.join(tmp, "dcp")
        mp.spawn(_rank, args=(args.ranks, port, cfg, path, args.reps, out), nprocs=args.ranks)
        size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
        result = dict(out)
    print(f"DCP checkpoint: {size / 1e6:.1f} MB, FSDP2 on {args.ranks} ranks, {args.reps} repetitions, "
          f"page caches {'dropped' if result['dropped'] else 'NOT dropped (warm)'} before each load")
    for name in ("dcp.load", "bcp.load"):
        values = result[name]
        runs = ", ".join(f"{v:.3f}" for v in values)
        print(f"  {name}: median {statistics.median(values):.3f} s  ({runs})")
    ratio = statistics.median(result["bcp.load"]) / statistics.median(result["dcp.load"])
    print(f"  ratio bcp.load / dcp.load: {ratio:.2f}")


if __name__ == "__main__":
    main()
