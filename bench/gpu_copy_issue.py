"""What queuing a save's device-to-host copies costs the host, without a profiler (GPU only).

    python3 bench/gpu_copy_issue.py --gb 3.56 --pieces 808 --reps 3

Under torch.profiler the 808 ``copy_`` calls of a 3.56 GB save took ~180 µs each to queue
on an H200 host, twice the DMA's time, and the blocking save's copy ran at 28 GB/s against
46 for the overlapped one (docs/performance/gpu.md). A profiler adds work to every CUDA call,
so this probe times the same queuing with ``time.perf_counter`` only, case by case, into:

- ``registered``: views of the engine's own staging arena (mmap, ``cudaHostRegister``);
- ``registered-no-record``: the same without ``record_stream`` on each source;
- ``torch-pinned``: views of one ``torch.empty(pin_memory=True)`` buffer;
- ``engine``: ``staging.Stager(...).run()``, the engine's grouped queuing (one event per group);
- ``profiled``: ``registered`` under ``torch.profiler`` (CPU and CUDA activities).

Each case queues every copy on a side stream that first sleeps on the device
(``torch.cuda._sleep``), so the DMA starts only once everything is queued: "queue" is the
host's time per copy, "DMA" the copies' own time on the device (events after the sleep).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bytecheckpoint.engine import staging  # noqa: E402

CASES = ("registered", "registered-no-record", "torch-pinned", "engine", "profiled")


def sources(gb: float, pieces: int) -> list[torch.Tensor]:
    """``pieces`` fp32 device tensors of about ``gb`` GB in all, of uneven sizes as a model's are."""
    total = int(gb * 1e9) // 4
    weights = [1 + (i * 7919) % 13 for i in range(pieces)]  # a spread of 1 to 13 parts
    unit = max(1, total // sum(weights))
    return [torch.randn(w * unit, device="cuda") for w in weights]


def views(arena: torch.Tensor, srcs: list[torch.Tensor]) -> list[torch.Tensor]:
    out, pos = [], 0
    for s in srcs:
        n = s.numel() * s.element_size()
        out.append(arena[pos : pos + n].view(s.dtype))
        pos += -(-n // 64) * 64
    return out


def arena_bytes(srcs: list[torch.Tensor]) -> int:
    return sum(-(-s.numel() * s.element_size() // 64) * 64 for s in srcs)


def queue_loop(srcs: list[torch.Tensor], dsts: list[torch.Tensor], record: bool,
               profiled: bool = False) -> tuple[float, float]:
    """Seconds to queue every copy on the host, and the copies' own seconds on the device."""
    side = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # ~1 s: every copy is queued before the first runs
        start.record(side)
        ctx: Any = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                       torch.profiler.ProfilerActivity.CUDA]) \
            if profiled else _Null()
        with ctx:
            t = time.perf_counter()
            for s, d in zip(srcs, dsts):
                if record:
                    s.record_stream(side)
                d.copy_(s, non_blocking=True)
            queued = time.perf_counter() - t
            end.record(side)
            end.synchronize()
    return queued, start.elapsed_time(end) / 1e3


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def engine(srcs: list[torch.Tensor]) -> tuple[float, float]:
    """The engine's Stager: host seconds until every copy is queued, and until they landed."""
    stager = staging.Stager(srcs)
    queued: list[float] = []
    t = time.perf_counter()
    stager.run(on_queued=lambda events: queued.append(time.perf_counter() - t))
    return queued[0], time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=3.56)
    parser.add_argument("--pieces", type=int, default=808)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_copy_issue.py needs a CUDA GPU (none found); nothing was measured")
    srcs = sources(args.gb, args.pieces)
    nbytes = sum(s.numel() * s.element_size() for s in srcs)
    registered = staging.pool(True, "probe").reserve(arena_bytes(srcs))
    pinned = torch.empty(arena_bytes(srcs), dtype=torch.uint8, pin_memory=True)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; {len(srcs)} copies, "
          f"{nbytes / 1e9:.2f} GB; arena registered: {staging.pool(True, 'probe').is_pinned}")
    print(f"{'case':<22} {'queue µs/copy':>14} {'queue ms':>9} {'DMA ms':>8} {'GB/s':>6}")
    for case in args.cases.split(","):
        rows = []
        for _ in range(args.reps + 1):  # the first is a warm-up
            if case == "engine":
                q, total = engine(srcs)
                rows.append((q, total))
                continue
            dst = views(pinned if case == "torch-pinned" else registered, srcs)
            rows.append(queue_loop(srcs, dst, record=case != "registered-no-record",
                                   profiled=case == "profiled"))
        q = statistics.median(r[0] for r in rows[1:])
        d = statistics.median(r[1] for r in rows[1:])
        label = "until landed" if case == "engine" else "DMA"
        print(f"{case:<22} {q / len(srcs) * 1e6:>14.1f} {q * 1e3:>9.1f} {d * 1e3:>8.1f} "
              f"{nbytes / d / 1e9:>6.1f}{'  (' + label + ')' if case == 'engine' else ''}", flush=True)


if __name__ == "__main__":
    main()
