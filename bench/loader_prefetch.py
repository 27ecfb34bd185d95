"""Cost of collecting a data loader's state at a checkpoint step, with and without prefetch.

A 4-worker TokenLoader whose workers each buffer ~25 MB of tokens (~100 MB in all). At a
step announced by ``checkpoint_every`` the workers send their state during the previous
batch; at other steps the state is requested when the checkpoint is taken. Prints the
median collection time of each and the ratio.

    .venv/bin/python bench/loader_prefetch.py [--buffer-mb 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from bytecheckpoint.data import TokenLoader, write_source


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--buffer-mb", type=float, default=100.0, help="tokens buffered, all workers")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    per_worker = int(args.buffer_mb * 1e6 / 4 / args.workers)  # int32 tokens
    root = tempfile.mkdtemp(prefix="bcp-loader-bench-")
    rng = np.random.default_rng(0)
    total = per_worker * args.workers * 2 + 10_000_000
    lengths = rng.integers(512, 8192, size=total // 4000)
    tokens = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.int32)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    path = write_source(f"{root}/source", (tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])))
    every = 4
    loader = TokenLoader([path], context=2048, batch_size=8, workers=args.workers,
                         buffer_tokens=per_worker, checkpoint_every=every, dp_rank=0, dp_size=1)
    prepared, on_demand = [], []
    t0 = time.perf_counter()
    step = 0
    while len(prepared) < args.repeats or len(on_demand) < args.repeats:
        next(loader)
        step += 1
        if step % every == 0:  # announced checkpoint step: prepared during the previous batch
            time.sleep(0.5)  # stands in for the training step in which the workers prepare
            loader.checkpoint_shards()
            assert loader.last_collect_prepared
            prepared.append(loader.last_collect_s)
        elif step % every == 2:  # an unannounced checkpoint
            loader.checkpoint_shards()
            assert not loader.last_collect_prepared
            on_demand.append(loader.last_collect_s)
    loader.close()
    buffered = args.workers * per_worker * 4 / 1e6
    p, o = statistics.median(prepared), statistics.median(on_demand)
    print(f"{args.workers} workers, {buffered:.0f} MB of buffered tokens, {step} batches "
          f"in {time.perf_counter() - t0:.1f} s")
    print(f"state collection at the checkpoint step, median of {args.repeats}:")
    print(f"  on demand   {1e3 * o:9.2f} ms")
    print(f"  prefetched  {1e3 * p:9.2f} ms")
    print(f"  ratio       {o / p:9.1f}x")


if __name__ == "__main__":
    main()
