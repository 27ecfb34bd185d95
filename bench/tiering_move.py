"""Cooling one checkpoint: how long each phase of a move takes, and loads before and after.

Usage: python bench/tiering_move.py [--gib 1] [--files 4] [--runs 3] [--dir /work/tmp]

Saves a checkpoint of ``--gib`` GiB (one process, ``--files`` parameters, so that many
storage files' worth of boxes) into a hot directory, then cools it with one
``storage_tiering`` pass into a cold directory. Phases come from the mover's step hook:
copy (read hot, check the checkpoint's checksums, write and fsync cold), verify (read the
cold copy back with its cached pages dropped), remap (the atomic link switch of every
file), free. Then it loads the checkpoint through its original path, cooled, against a
hot copy of it. Both tiers are directories on the same disk here, so the figures measure
the mover, not an SSD against an HDD. Prints the median of ``--runs`` runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("BCP_TELEMETRY_DIR", tempfile.mkdtemp(prefix="bcp-bench-telemetry-"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import bytecheckpoint as bcp  # noqa: E402
from storage_tiering import load_config, run_once  # noqa: E402


class Blob(nn.Module):
    def __init__(self, nbytes: int, n: int) -> None:
        super().__init__()
        per = nbytes // n // 4
        self.p = nn.ParameterList([nn.Parameter(torch.randn(per)) for _ in range(n)])


def _drop_cache(root: str) -> None:
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.realpath(os.path.join(d, n))
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def one_run(base: str, model: Blob) -> dict[str, float]:
    hot, cold = f"{base}/ssd", f"{base}/hdd"
    shutil.rmtree(base, ignore_errors=True)
    bcp.save(f"{hot}/run/step_1", {"model": model}, step=1)
    bcp.save(f"{hot}/run/step_2", {"model": {"marker": torch.zeros(1)}}, step=2)  # stays hot (latest)
    shutil.copytree(f"{hot}/run/step_1", f"{base}/hot-copy/step_1")
    marks: dict[str, float] = {}
    t0 = time.perf_counter()
    report = run_once(load_config(env={}, hot=hot, cold=cold, cool_after=0, keep_newest=0),
                      on_step=lambda step: marks.setdefault(step, time.perf_counter()))
    end = time.perf_counter()
    assert [os.path.basename(r.checkpoint) for r in report.cooled] == ["step_1"], report.failed
    out = {
        "bytes": report.cooled[0].bytes,
        "pass_s": end - t0,
        "copy_s": marks["copied"] - t0,  # the scan before it takes milliseconds
        "verify_s": marks["verified"] - marks["copied"],
        "remap_s": marks["remapped"] - marks["verified"],
        "free_s": end - marks["free"],
    }
    for label, path in (("load_hot_s", f"{base}/hot-copy/step_1"), ("load_cooled_s", f"{hot}/run/step_1")):
        _drop_cache(path)
        target = Blob(1, len(model.p))
        for p, q in zip(target.p, model.p):
            p.data = torch.empty_like(q)
        t = time.perf_counter()
        bcp.load(path, {"model": target})
        out[label] = time.perf_counter() - t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bcp-tiering-bench-", dir=args.dir)
    model = Blob(int(args.gib * 2**30), args.files)
    runs = []
    try:
        for i in range(args.runs):
            runs.append(one_run(f"{base}/r", model))
            r = runs[-1]
            print(f"run {i + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k != "bytes"))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    nbytes = runs[0]["bytes"]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"\ncheckpoint {nbytes / 2**30:.2f} GiB, median of {len(runs)} runs:")
    for k in ("pass_s", "copy_s", "verify_s", "remap_s", "free_s", "load_hot_s", "load_cooled_s"):
        rate = f"  ({nbytes / med[k] / 1e6:,.0f} MB/s)" if k in ("pass_s", "copy_s", "verify_s") else ""
        print(f"  {k:<14} {med[k]:.4f} s{rate}")


if __name__ == "__main__":
    main()
