"""The long fuzz run: ``python -m tests.fuzz.long_run --cases 100000`` (scripts/fuzz_long.sh).

Cases are drawn deterministically from ``--seed`` (case ``i`` of a target is the same on
every run), split over the targets by ``cases.WEIGHTS`` and run in batches by a pool of
guarded worker processes: each runs its batch in-process, thousands of cases a second for
the cheap targets, and the parent turns a worker that dies or stalls into a crash or hang
finding naming the case, then carries on after it. Prints counts per target and outcome;
exits 1 on any bad outcome (raw exception, wrong data, crash, hang, or a fuzzer error).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from collections import Counter

from tests.fuzz.cases import TARGETS, WEIGHTS
from tests.fuzz.guard import Guard
from tests.fuzz.outcomes import KINDS, Tally


def plan(total: int, targets: list[str], batch: int) -> list[tuple[str, int, int]]:
    weight = sum(WEIGHTS[t] for t in targets)
    jobs = []
    for t in targets:
        n = max(1, total * WEIGHTS[t] // weight)
        jobs += [(t, start, min(batch, n - start)) for start in range(0, n, batch)]
    # Interleave targets so a stopped run still covered each of them.
    jobs.sort(key=lambda j: (j[1], targets.index(j[0])))
    return jobs


def run(total: int, seed: int, workers: int, batch: int, targets: list[str], timeout: float) -> Tally:
    jobs = plan(total, targets, batch)
    tally, lock = Tally(), threading.Lock()
    done = Counter()
    started = time.monotonic()

    def drain() -> None:
        guard = Guard(timeout=timeout)
        try:
            while True:
                with lock:
                    if not jobs:
                        return
                    target, start, count = jobs.pop(0)
                local = Tally()
                guard.batch(target, seed, start, count, local)
                with lock:
                    tally.merge({f"{t}:{k}": n for (t, k), n in local.counts.items()}, local.findings)
                    done[target] += count
                    total_done = sum(done.values())
                    if total_done // 5000 != (total_done - count) // 5000:
                        rate = total_done / (time.monotonic() - started)
                        print(f"  {total_done} cases, {rate:.0f}/s, bad so far: {tally.bad}", flush=True)
        finally:
            guard.close()
            shutil.rmtree(guard.workdir, ignore_errors=True)

    threads = [threading.Thread(target=drain, name=f"fuzz-{i}") for i in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return tally


def report(tally: Tally, wall: float) -> str:
    kinds = [k for k in KINDS if any(kind == k for (_, kind) in tally.counts)] or list(KINDS[:2])
    extra = sorted({kind for (_, kind) in tally.counts} - set(KINDS))
    kinds += extra
    lines = [f"{'target':<18}" + "".join(f"{k:>9}" for k in kinds) + f"{'total':>9}"]
    targets = sorted({t for (t, _) in tally.counts})
    for t in targets:
        row = [tally.counts.get((t, k), 0) for k in kinds]
        lines.append(f"{t:<18}" + "".join(f"{n:>9}" for n in row) + f"{sum(row):>9}")
    total = sum(tally.counts.values())
    rate = total / max(wall, 1e-9)
    lines.append(f"{total} cases in {wall:.1f} s ({rate:.0f}/s); bad outcomes: {tally.bad}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz.long_run", description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=100_000, help="mutations in all (default 100000)")
    p.add_argument("--seed", type=int, default=0, help="case i of a target is the same for a given seed")
    p.add_argument("--workers", type=int, default=max(1, min(4, (os.cpu_count() or 2))))
    p.add_argument("--batch", type=int, default=500, help="cases per worker request")
    p.add_argument("--targets", default=",".join(TARGETS), help="a comma-separated subset of: "
                   + ",".join(TARGETS))
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take before it is a hang")
    p.add_argument("--json", metavar="FILE", help="also write counts and findings here")
    args = p.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown or args.cases < 1 or args.workers < 1 or args.batch < 1:
        p.error(f"bad arguments (unknown targets: {sorted(unknown)})" if unknown else "counts must be >= 1")
    print(f"fuzz: {args.cases} cases over {','.join(targets)}, seed {args.seed}, {args.workers} workers",
          flush=True)
    t0 = time.monotonic()
    tally = run(args.cases, args.seed, args.workers, args.batch, targets, args.timeout)
    wall = time.monotonic() - t0
    print(report(tally, wall))
    for f in tally.findings:
        print(f"\n[{f['kind']}] {f['target']} {f['case']}\n{str(f['detail'])[-1500:]}")
    if args.json:
        with open(args.json, "w") as out:
            counts = {f"{t}:{k}": n for (t, k), n in tally.counts.items()}
            json.dump({"seed": args.seed, "wall_s": wall, "counts": counts, "findings": tally.findings}, out,
                      indent=1, default=repr)
    return 1 if tally.bad else 0


if __name__ == "__main__":
    sys.exit(main())
