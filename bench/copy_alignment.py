"""The copy from the page cache into tensors, by where the pieces sit in the file.

    .venv/bin/python bench/copy_alignment.py                 # 512 MiB, ~30 s
    .venv/bin/python bench/copy_alignment.py --mib 1024 --reps 7

A load ends every read with a copy from the page cache into the target tensor (preadv), and
how fast that copy runs depends on whether the file offset and the tensor's address share
their offset within a 64-byte cache line. This writes one file of ``--mib`` MiB, reads it once
into the page cache, then reads it ``--reps`` times (warm: no disk) into 4 MiB torch tensors
(64-byte aligned, as torch allocates them) with the pieces starting at offset 0 from the data
start and at 8, 16, 32 and 48 bytes past a cache line (the layout of format version 2, where
pieces sat wherever the header's length put them; version 3 aligns them: ``engine.files``).
Prints the median GB/s per offset, in the engine's own request pattern (``read_spans``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bytecheckpoint.engine.load_pipeline import read_spans  # noqa: E402
from bytecheckpoint.storage.local import LocalStorage  # noqa: E402

PIECE = 4 << 20
SHIFTS = (0, 8, 16, 32, 48)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    os.environ["BCP_STORAGE_DROP_BEHIND"] = "0"  # keep the pages: this measures the copy alone
    storage = LocalStorage(fsync=False)
    size = args.mib << 20
    path = os.path.join(args.dir, f"bcp-copy-alignment-{os.getpid()}")
    pieces = [torch.empty(PIECE, dtype=torch.uint8).fill_(1) for _ in range(size // PIECE)]
    assert all(p.data_ptr() % 64 == 0 for p in pieces)
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20) * (size // (1 << 20) + 1))
        with open(path, "rb") as f:  # into the page cache
            while f.read(64 << 20):
                pass
        print(f"{args.mib} MiB in {len(pieces)} pieces of 4 MiB, warm page cache, medians of {args.reps}")
        results = {}
        for _ in range(args.reps):
            for shift in SHIFTS:  # interleaved, so drift hits every offset alike
                spans = [(shift + i * PIECE, memoryview(p.numpy())) for i, p in enumerate(pieces)]
                t = time.perf_counter()
                got = read_spans(storage, path, spans)
                results.setdefault(shift, []).append(size / (time.perf_counter() - t) / 1e9)
                assert sum(got) == size
        base = statistics.median(results[0])
        for shift in SHIFTS:
            med = statistics.median(results[shift])
            print(f"  pieces {shift:2d} bytes past a cache line: {med:6.2f} GB/s "
                  f"({med / base:.2f} of aligned)")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
