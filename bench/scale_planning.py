"""Planning, metadata and coordination for a 405B Llama with Adam at 1k-16k ranks, simulated.

    .venv/bin/python bench/scale_planning.py [--worlds 1024 4096 8960 16384] [--repeats 3]
                                             [--files-per rank|host] [--memory]

Layout: TP=8, PP=16, ZeRO-1 DP over the rest (``bytecheckpoint.planning.simulate``). For each world
size it builds every rank's local plan (not timed: ranks do that in parallel), then runs the
coordinator's real code ``--repeats`` times and prints the median of each stage:
plan (dedup, balance, coverage), template + build (the metadata), encode, decode (a load's
first step), and cached (a plan-cache hit: shared-object check and metadata from the cached
template). "planning" is plan + template + build + encode. Then the growth exponent k
(t ∝ n^k) between successive sizes, against n log n's, the storage files and file-system
metadata operations per save with one file per rank and kind or per host and kind, and the
coordination tree's fan-in. ``--memory`` adds each stage's peak allocation (tracemalloc,
one extra run per size; slower).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from bytecheckpoint.planning.simulate import (
    LLAMA_405B,
    Layout,
    growth_exponent,
    local_plans,
    nlogn_exponent,
    simulate,
)
from bytecheckpoint.runtime.comm import tree_layout

STAGES = ("plan", "template", "build", "encode", "decode", "cached")
TARGETS_AT = 8960


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[1024, 4096, 8960, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--files-per", choices=("rank", "host"), default="rank")
    parser.add_argument("--memory", action="store_true")
    args = parser.parse_args()
    spec = LLAMA_405B
    print(f"model: {spec.parameters / 1e9:.1f}B parameters, {spec.layers} layers, hidden {spec.hidden}, "
          f"ffn {spec.ffn}, vocab {spec.vocab}; bf16 weights + fp32 master/exp_avg/exp_avg_sq; "
          f"TP=8 PP=16 ZeRO-1; median of {args.repeats} runs")
    rows = []
    for world in args.worlds:
        layout = Layout.for_world(world)
        t = time.perf_counter()
        plans = local_plans(spec, layout)
        gen_s = time.perf_counter() - t
        runs = []
        for _ in range(args.repeats):
            runs.append(simulate(spec, layout, files_per=args.files_per, plans=plans))
            gc.collect()
        med = {s: statistics.median(r.stages[s].seconds for r in runs) for s in STAGES}
        med["planning"] = statistics.median(r.planning_s for r in runs)
        peaks = {}
        if args.memory:
            traced = simulate(spec, layout, files_per=args.files_per, plans=plans, memory=True)
            peaks = {s: v.peak_mib for s, v in traced.stages.items()}
        r = runs[-1]
        tree = tree_layout(world, layout.ranks_per_host, 16)
        depth = 0
        node = tree[world - 1]
        while node.parent is not None:
            node, depth = tree[node.parent], depth + 1
        rows.append((world, med))
        print(f"\n== {world} ranks (DP={layout.dp}, {world // layout.ranks_per_host} hosts) ==")
        print(f"  local plans: {r.offered_boxes:,} boxes offered (generated in {gen_s:.2f} s, not timed); "
              f"metadata: {r.metadata_boxes:,} boxes, {r.tensors:,} tensors, {r.metadata_bytes / 1e6:.1f} MB")
        for s in (*STAGES, "planning"):
            extra = f"  peak {peaks[s]:7.1f} MiB" if s in peaks else ""
            print(f"  {s:9s} {med[s]:8.3f} s{extra}")
        for mode, ops in r.files.items():
            print(f"  files per {mode}: {ops.files:,} files, {ops.total:,} metadata-server ops per save "
                  f"({ops.creates:,} creates, {ops.blocks:,} block allocations)")
        print(f"  coordination: flat gather = {world - 1:,} messages into the coordinator; tree "
              f"(8 per host, fan-out 16) = {len(tree[0].children)} into the coordinator, at most "
              f"{max(len(n.children) for n in tree)} into any rank, depth {depth}")
        print(f"  process peak RSS {r.rss_mib:.0f} MiB")
        del plans, runs
        gc.collect()

    if len(rows) > 1:
        print("\ngrowth exponent k (t ∝ n^k) between successive sizes; n log n gives the last column")
        print("  " + " ".join(f"{s:>9s}" for s in ("sizes", *STAGES, "planning", "n log n")))
        for (n1, a), (n2, b) in zip(rows, rows[1:]):
            ks = [growth_exponent(n1, a[s], n2, b[s]) for s in (*STAGES, "planning")]
            print(f"  {n1:>4}-{n2:<5}" + " ".join(f"{k:9.2f}" for k in ks) + f"{nlogn_exponent(n1, n2):9.2f}")
    sizes = dict(rows)
    if 4096 in sizes and 16384 in sizes:  # the growth target, end to end
        a, b = sizes[4096], sizes[16384]
        ks = [growth_exponent(4096, a[s], 16384, b[s]) for s in (*STAGES, "planning")]
        print(f"  {4096:>4}-{16384:<5}" + " ".join(f"{k:9.2f}" for k in ks)
              + f"{nlogn_exponent(4096, 16384):9.2f}")
    for world, med in rows:
        if world == TARGETS_AT:
            print(f"\ntargets at {world}: planning {med['planning']:.2f} s (< 10), cached re-plan "
                  f"{med['cached']:.3f} s (< 0.5), metadata load {med['decode']:.3f} s (< 2)")


if __name__ == "__main__":
    main()
