"""What slows a launch-bound training loop while a save's threads work beside it.

    python bench/loop_interference.py --gb 3.56        # on a many-core host (a GPU machine's)
    python bench/loop_interference.py --gb 0.25 --reps 1   # the logic, quickly

On a GPU a training loop that launches kernels from Python runs at the speed of its host
thread, and an async save's writer threads work beside it (on one H200 the 3.56 GB loop's
steps ran 40-60% slower while the write lasted). This probe runs tiny torch ops in the main
thread (each releases the GIL in its dispatch, as a kernel launch does) and measures their
rate while other threads do one thing at a time, so the causes can be told apart:

  idle        nothing beside the loop
  hash-4MiB   xxh3 over the buffer (passes, for --seconds) in 4 MiB calls, as a save's checksums (the GIL is
              released in each call and taken back after it)
  hash-64MiB  the same bytes in 64 MiB calls: the same memory traffic, 16x fewer handoffs
  copy        torch copy_ of the buffer in 64 MiB pieces: memory traffic alone
  handoffs    time.sleep for as long as a 4 MiB hash takes, as many times: the handoffs of
              hash-4MiB without its memory traffic
  write       the save's own writer loop (engine.files.write_file: 4 MiB checksums, then
              the write, direct where the disk allows) of each thread's part to --dir,
              as an async save's writers do after a D2H copy
  save        bcp.save(async_save=True) of the buffer as a module's tensors, to --dir (on
              CPU tensors this includes the snapshot's memory copy)

Prints the loop's op rate in each case as a fraction of its rate when idle (medians of
--reps), and how long each case lasted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = ("idle", "hash-4MiB", "hash-64MiB", "copy", "handoffs", "write", "save")


def loop_rate(busy: Callable[[], bool]) -> float:
    """Tiny ops per second in this thread while ``busy()`` is true (at least 0.5 s)."""
    x = torch.zeros(16)
    ops, t0 = 0, time.perf_counter()
    while True:
        for _ in range(100):
            x.add_(1)
        ops += 100
        elapsed = time.perf_counter() - t0
        if elapsed > 0.5 and not busy():
            return ops / elapsed


def in_threads(work: Callable[[int], None], threads: int) -> Callable[[], bool]:
    """Start ``work(i)`` in ``threads`` threads; the returned callable says whether any runs."""
    started = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for t in started:
        t.start()
    return lambda: any(t.is_alive() for t in started)


def run_case(case: str, flat: torch.Tensor, threads: int, root: str,
             seconds: float) -> tuple[float, float]:
    """The loop's op rate during ``case`` (the synthetic ones repeat for ``seconds``), and how
    long the case lasted."""
    import bytecheckpoint as bcp

    view = memoryview(flat.numpy()).cast("B")
    share = -(-len(view) // threads)
    parts = [view[i * share : (i + 1) * share] for i in range(threads)]

    deadline = time.perf_counter() + seconds

    def hasher(step: int) -> Callable[[int], None]:
        def work(i: int) -> None:
            mv = parts[i]
            while time.perf_counter() < deadline:  # passes over this thread's part
                for a in range(0, len(mv), step):
                    xxhash.xxh3_64_intdigest(mv[a : a + step])
        return work

    one_hash_s = 0.0
    if case == "handoffs":  # how long one 4 MiB hash takes here
        t = time.perf_counter()
        for a in range(0, 64 << 20, 4 << 20):
            xxhash.xxh3_64_intdigest(view[a : a + (4 << 20)])
        one_hash_s = (time.perf_counter() - t) / 16

    def copier(i: int) -> None:
        src = flat[i * (share // 4) : (i + 1) * (share // 4)]
        dst = torch.empty(64 << 18)
        while time.perf_counter() < deadline:
            for a in range(0, src.numel(), dst.numel()):
                piece = src[a : a + dst.numel()]
                dst[: piece.numel()].copy_(piece)

    def writer(i: int) -> None:
        from bytecheckpoint.engine.files import Piece, write_file
        from bytecheckpoint.format.checksums import DEFAULT_CHUNK_BYTES
        from bytecheckpoint.storage import open_storage

        storage, base = open_storage(root)
        part = parts[i]
        piece = Piece(name="t", code="F32", shape=(len(part) // 4,), nbytes=len(part),
                      source=lambda: part, address=flat.data_ptr() + i * share)
        write_file(storage, f"{base}/part{i}", [piece], DEFAULT_CHUNK_BYTES, {})

    def sleeper(i: int) -> None:
        while time.perf_counter() < deadline:
            time.sleep(one_hash_s)

    t0 = time.perf_counter()
    if case == "idle":
        busy = lambda: time.perf_counter() < deadline  # noqa: E731
    elif case == "save":
        module = torch.nn.Module()
        for i, piece in enumerate(flat.chunk(64)):
            module.register_buffer(f"t{i}", piece)
        shutil.rmtree(root, ignore_errors=True)
        handle = bcp.save(root, {"model": module}, async_save=True)
        busy = lambda: not handle.done()  # noqa: E731
    elif case == "write":
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        busy = in_threads(writer, threads)
    else:
        work = {"hash-4MiB": hasher(4 << 20), "hash-64MiB": hasher(64 << 20),
                "copy": copier, "handoffs": sleeper}[case]
        busy = in_threads(work, threads)
    rate = loop_rate(busy)
    lasted = time.perf_counter() - t0
    if case == "save":
        handle.wait()
    if case in ("save", "write"):
        shutil.rmtree(root, ignore_errors=True)
    return rate, lasted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=3.56, help="bytes the save's threads work on")
    parser.add_argument("--threads", type=int, default=2, help="threads beside the loop")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.5, help="length of each synthetic case")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "bcp-bench-interference"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # the loop's ops are tiny: its cost is its thread's Python
    flat = torch.randn(int(args.gb * 1e9) // 4)
    cases = args.cases.split(",")
    rates: dict[str, list[float]] = {c: [] for c in cases}
    lasted: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(args.reps):
        for case in cases:  # interleaved, so drift hits every case alike
            rate, s = run_case(case, flat, args.threads, args.dir, args.seconds)
            rates[case].append(rate)
            lasted[case].append(s)
    idle = statistics.median(rates["idle"]) if "idle" in rates else None
    print(f"{os.cpu_count()} cores, torch {torch.__version__}, {args.gb} GB, {args.threads} threads "
          f"beside the loop, medians of {args.reps}")
    for case in cases:
        rate = statistics.median(rates[case])
        rel = f"{rate / idle:5.2f} of idle" if idle else ""
        took = statistics.median(lasted[case])
        print(f"  {case:11s} {rate / 1e3:8.1f} k ops/s  {rel}   lasted {took:.2f} s")


if __name__ == "__main__":
    main()
