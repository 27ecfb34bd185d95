"""A load against its own ranks reading the same files: where the bytes land, cold and warm.

    .venv/bin/python bench/load_landing.py                                  # 1.3gb, ~2 min
    .venv/bin/python bench/load_landing.py --model 3.56gb --reps 4 --modes read,read-pieces,load
    .venv/bin/python bench/load_landing.py --model 3.56gb --reps 4 --modes warm-load

4 FSDP2 ranks (GPT + AdamW, gloo) save one checkpoint, then, in rotation, ``--reps`` times
each, with the page cache dropped (and the disk left idle 2 s) before every cold mode:

  read         each rank reads its own data files whole into one numpy buffer of their size
               (touched beforehand; numpy backs buffers of 4 MiB and more with huge pages)
  read-pieces  each rank reads its own files' pieces into one torch tensor per piece (touched
               beforehand, as a model's tensors are), with the engine's request pattern
  load         ``bcp.load`` into the same layout
  warm-load    ``bcp.load`` with every file in the page cache (``BCP_STORAGE_DROP_BEHIND=0``,
               so the load does not drop what it read): the copies and the CPU, no disk
  load-one-descriptor
               ``bcp.load`` as before 448a4b6: each sequential request through one
               descriptor however long (the local backend now opens a fresh one every 64 MiB)

Both reads are 4 MiB preadv calls with consumed pages dropped, as the engine reads. Prints per
mode the median GB/s and the CPU seconds (user, system) summed over the 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import struct
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MODELS, free_port, gather, max_over_ranks  # noqa: E402
from bench.load_vs_read_limit import READ_CALL, data_files, drop_cache, saved_state  # noqa: E402

MODES = ("read", "read-pieces", "load", "warm-load", "load-one-descriptor")


def own_files(path: str, rank: int) -> list[str]:
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(f"{rank:05d}.safetensors"))


def pieces_of(file: str) -> list[tuple[int, int]]:
    """(absolute offset, length) of every entry but padding, in file order."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    spans = [(8 + n + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
             for k, v in header.items() if not k.startswith("__padding__/")]
    return sorted(spans)


def read_whole(files: list[str], buffers: list[np.ndarray]) -> None:
    for file, buf in zip(files, buffers):
        fd = os.open(file, os.O_RDONLY)
        try:
            size, done, view = os.path.getsize(file), 0, memoryview(buf)
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
            while done < size:
                got = os.preadv(fd, [view[done : done + min(READ_CALL, size - done)]], done)
                os.posix_fadvise(fd, done, got, os.POSIX_FADV_DONTNEED)
                done += got
        finally:
            os.close(fd)


def read_pieces(files: list[str], tensors: list[list[torch.Tensor]]) -> None:
    from bytecheckpoint.engine.load_pipeline import read_spans
    from bytecheckpoint.storage.local import LocalStorage

    storage = LocalStorage(fsync=False)
    for file, ts in zip(files, tensors):
        spans = [(off, memoryview(t.numpy())) for (off, _), t in zip(pieces_of(file), ts)]
        read_spans(storage, file, spans)


def worker(rank: int, world: int, port: int, model: str, reps: int, modes: list[str], path: str,
           out: str) -> None:
    import bytecheckpoint as bcp

    state = saved_state(rank, world, port, model, path)
    files, all_files = own_files(path, rank), data_files(path)
    total = sum(n for _, n in all_files)
    buffers = [np.ones(os.path.getsize(f), np.uint8) for f in files] if "read" in modes else []
    tensors = ([[torch.ones(n, dtype=torch.uint8) for _, n in pieces_of(f)] for f in files]
               if "read-pieces" in modes else [])
    results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    for rep in range(reps):
        for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:
            dist.barrier()
            if rank == 0:
                if mode == "warm-load":
                    for f, _ in all_files:
                        with open(f, "rb") as fh:
                            while fh.read(64 << 20):
                                pass
                else:
                    drop_cache([f for f, _ in all_files])
            if mode == "warm-load":
                os.environ["BCP_STORAGE_DROP_BEHIND"] = "0"
            dist.barrier()
            r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            if mode == "read":
                read_whole(files, buffers)
            elif mode == "read-pieces":
                read_pieces(files, tensors)
            elif mode == "load-one-descriptor":
                from bytecheckpoint.storage import local

                every, local._DESCRIPTOR_BYTES = local._DESCRIPTOR_BYTES, 1 << 62
                try:
                    bcp.load(path, state, framework="fsdp2")
                finally:
                    local._DESCRIPTOR_BYTES = every
            else:
                bcp.load(path, state, framework="fsdp2")
            elapsed = max_over_ranks(time.perf_counter() - t)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            os.environ.pop("BCP_STORAGE_DROP_BEHIND", None)
            cpu = gather((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime))
            results[mode].append((total / elapsed / 1e9, sum(c[0] for c in cpu), sum(c[1] for c in cpu)))
            if rank == 0:
                print(f"  rep {rep + 1}: {mode} {total / elapsed / 1e9:.2f} GB/s", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"bytes": total, "results": results}, f)
    dist.barrier()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1.3gb", choices=sorted(MODELS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "bcp-bench-landing"))
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    out = os.path.join(args.dir, "results.json")
    try:
        mp.spawn(worker, args=(4, free_port(), args.model, args.reps, modes,
                               os.path.join(args.dir, "ckpt"), out), nprocs=4)
        with open(out) as f:
            res = json.load(f)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(f"{args.model}: {res['bytes'] / 1e9:.2f} GB, 4 ranks, medians of {args.reps}")
    for mode, runs in res["results"].items():
        gbs = statistics.median(r[0] for r in runs)
        user = statistics.median(r[1] for r in runs)
        system = statistics.median(r[2] for r in runs)
        print(f"  {mode:12s} {gbs:5.2f} GB/s   CPU s over ranks: user {user:.2f}, system {system:.2f}"
              f"   (GB/s of each rep: {', '.join(f'{r[0]:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()
