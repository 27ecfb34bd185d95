"""CPU of writing storage files: by the block size pieces are hashed and written in, and direct.

    .venv/bin/python bench/write_block.py                     # 4 processes x 1 GiB, ~1 min
    .venv/bin/python bench/write_block.py --blocks 16,8,4,2 --reps 5
    .venv/bin/python bench/write_block.py --blocks 4,direct --reps 5

``engine.files.write_file`` hashes each block of a piece (xxh3 per checksum chunk), then
writes it, so the copy into the page cache reads the block while it is still in the CPU's
caches, if it fits. Here ``--procs`` processes (as ranks on one host) each write 1 GiB of
float32 pieces (8 of 32 MiB, 4 files of 256 MiB, fsync on, drop-behind as configured) to
``--dir`` at once, for each block size in rotation; prints wall time and the user and
system CPU summed over the processes (medians of ``--reps``). A number is a block size in MiB
written through the page cache (``BCP_STORAGE_DIRECT_WRITES=0``); ``direct`` writes as a save
does by default, the pieces placed for direct writes (``storage.direct_io``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def writer(block: int, index: int, directory: str, out: mp.Queue, start: mp.Barrier) -> None:
    import dataclasses

    import torch

    import bytecheckpoint.engine.files as files
    from bytecheckpoint.storage.config import settings
    from bytecheckpoint.storage.local import LocalStorage

    direct = block == DIRECT
    if not direct:
        files._WRITE_BLOCK = block
    torch.manual_seed(index)
    tensors = [torch.randn(8 << 20) for _ in range(8)]  # 8 x 32 MiB
    pieces = [files.Piece(f"p{i}", "F32", (t.numel(),), t.numel() * 4,
                          lambda t=t: memoryview(t.numpy()).cast("B"), address=t.data_ptr())
              for i, t in enumerate(tensors)]
    transfer = dataclasses.replace(settings().transfer, direct_writes=direct)
    storage = LocalStorage(fsync=True, transfer=transfer)
    path = os.path.join(directory, f"bcp-write-block-{os.getpid()}")
    start.wait()
    r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    try:
        for _ in range(4):
            files.write_file(storage, path, pieces, 4 << 20, {})
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        out.put((time.perf_counter() - t, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime))
    finally:
        if os.path.exists(path):
            os.unlink(path)


DIRECT = 0  # the "block" of the direct variant


def run(block: int, procs: int, directory: str) -> tuple[float, float, float]:
    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(procs)
    workers = [ctx.Process(target=writer, args=(block, i, directory, out, start))
               for i in range(procs)]
    for w in workers:
        w.start()
    results = [out.get() for _ in workers]
    for w in workers:
        w.join()
    return max(r[0] for r in results), sum(r[1] for r in results), sum(r[2] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="16,4,direct", help="MiB or 'direct', comma-separated")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--dir", default=os.path.join(root, "runs"), help="on the disk under test")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    blocks = [DIRECT if b == "direct" else int(b) << 20 for b in args.blocks.split(",")]
    results: dict[int, list[tuple[float, float, float]]] = {b: [] for b in blocks}
    for _ in range(args.reps):
        for block in blocks:
            results[block].append(run(block, args.procs, args.dir))
    print(f"{args.procs} processes x 1 GiB each, fsync on, medians of {args.reps}")
    for block, runs in results.items():
        wall, user, system = (statistics.median(r[i] for r in runs) for i in range(3))
        label = "direct        " if block == DIRECT else f"block {block >> 20:3d} MiB"
        print(f"  {label}: wall {wall:.2f} s, CPU user {user:.2f} s, system {system:.2f} s")


if __name__ == "__main__":
    main()
