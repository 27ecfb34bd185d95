"""Synchronous saves against the disk's write limit, measured in the same run.

    .venv/bin/python bench/save_vs_write_limit.py                          # 0.36 GB, ~1 min
    .venv/bin/python bench/save_vs_write_limit.py --models 1.3gb,3.56gb --reps 5
    .venv/bin/python bench/save_vs_write_limit.py --variant before:BCP_HOST_WRITERS=0 --variant after

For each model (``--models``; the GPT + AdamW workloads of bench/train_loop_cost.py), FSDP2
on 4 CPU processes (gloo) builds its state. Then, ``--reps`` times, each measurement after
``sync``, a dropped page cache and ``--settle`` seconds of idle disk:
  limit   rank 0 writes the state's byte count as S files at once, each one sequential
          stream of 16 MiB writes then fsync, with early writeback and drop-behind (the
          fastest way a single stream writes here; ``engine_vs_dcp.py`` measures the others),
          for S = 1, 2, 4, 8: the best is the write limit
  save    bcp.save of the state (every rank writes its share; the save's own commit,
          metadata and fsyncs included), once per ``--variant``
  paired  right before and right after each save, the limit again with the best count of
          the sweeps so far (the disk's speed drifts within a minute; measured next to each
          save it is an unbiased reference)
and prints each save's GB/s and its fraction of the limit: of the median sweep's best, and
the median of the paired ratios. ``--models skew`` is a state of two plain sharded tensors
(a model file and an optimizer file per rank) in which rank 0 holds 4 times what each other
rank holds: 2.82 GB, 1.61 GB of it rank 0's. ``--files`` also prints, from the ranks' telemetry, when
each rank's last large file was durable (its ``storage.commit``) and the longest wait for a
host write slot, per save: how evenly the ranks finished.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MODELS, env_set, free_port, gather, max_over_ranks  # noqa: E402
from bench.engine_vs_dcp import sequential_write  # noqa: E402
from bench.load_vs_read_limit import drop_cache, make_state, parse_variants  # noqa: E402

SWEEP = (1, 2, 4, 8)
BEHIND = 64 << 20  # early writeback every 64 MiB, as the engine's buffered writes


def write_limit(root: str, nbytes: int, streams: int) -> float:
    """GB/s of ``streams`` files written at once, ``nbytes`` in all, each with fsync."""
    os.makedirs(root, exist_ok=True)
    each = -(-nbytes // streams)
    drop_cache([])
    t = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda i: sequential_write(f"{root}/s{i}", each, behind=BEHIND, drop=True),
                      range(streams)))
    gbps = each * streams / (time.perf_counter() - t) / 1e9
    shutil.rmtree(root, ignore_errors=True)
    return gbps


def limits(root: str, nbytes: int, counts: list[int]) -> dict[int, float]:
    """Rank 0 writes; the others wait."""
    out: dict[int, float] = {}
    if dist.get_rank() == 0:
        for c in counts:
            out[c] = write_limit(f"{root}/limit", nbytes, c)
    dist.barrier()
    return out


def timed_save(variant: dict[str, str], state: dict[str, Any], path: str, framework: str | None) -> float:
    import bytecheckpoint as bcp

    dist.barrier()
    if dist.get_rank() == 0:
        drop_cache([])
    dist.barrier()
    with env_set(variant):
        t = time.perf_counter()
        bcp.save(path, state, framework=framework)
        elapsed = max_over_ranks(time.perf_counter() - t)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    return elapsed


def best_count(sweeps: list[dict[int, float]]) -> int:
    return max(SWEEP, key=lambda c: med([sw[c] for sw in sweeps]))


SKEW_UNITS = (4, 1, 1, 1)  # ``--models skew``: units of rows per rank
SKEW_ROW = 1 << 16  # float32 elements per row
SKEW_ROWS = {"model": 512, "optim": 1024}  # per unit: 128 and 256 MiB


def skewed_state(rank: int) -> dict[str, Any]:
    """Two row-sharded tensors, one per kind (a file each), rank 0 holding 4 units of rows and
    every other rank 1."""
    import bytecheckpoint as bcp

    first, units = sum(SKEW_UNITS[:rank]), sum(SKEW_UNITS)
    gen = torch.Generator().manual_seed(rank)
    state: dict[str, Any] = {}
    for kind, rows in SKEW_ROWS.items():
        data = torch.randn(SKEW_UNITS[rank] * rows, SKEW_ROW, generator=gen)
        state[kind] = {"t": bcp.TensorShard(data, (units * rows, SKEW_ROW), (first * rows, 0))}
    return state


def worker(rank: int, world: int, port: int, model: str, root: str, reps: int, out_file: str,
           variants: dict[str, dict[str, str]]) -> None:
    import bytecheckpoint as bcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=30))
    state = skewed_state(rank) if model == "skew" else make_state(MODELS[model], seed=0)
    framework = None if model == "skew" else "fsdp2"
    bcp.save(f"{root}/warm", state, framework=framework)  # first-save costs, and the byte count
    dist.barrier()
    nbytes = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(f"{root}/warm") for n in ns)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(f"{root}/warm")
    res: dict[str, Any] = {"bytes": nbytes, "sweeps": [], "saves": {v: [] for v in variants}}
    names = list(variants)
    for rep in range(reps):
        res["sweeps"].append(limits(root, nbytes, list(SWEEP)[:: 1 if rep % 2 == 0 else -1]))
        best = gather(best_count(res["sweeps"]) if rank == 0 else 0)[0]
        for v in names[rep % len(names):] + names[:rep % len(names)]:
            before = limits(root, nbytes, [best])
            s = timed_save(variants[v], state, f"{root}/ckpt", framework)
            after = limits(root, nbytes, [best])
            paired = (before[best] + after[best]) / 2 if rank == 0 else 0.0
            res["saves"][v].append({"s": s, "paired": paired, "best": best})
        if rank == 0:
            print(f"  rep {rep + 1}/{reps}: " + ", ".join(
                f"{v} {res['saves'][v][-1]['s']:.2f} s" for v in names), flush=True)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(res, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def report(name: str, res: dict[str, Any]) -> list[str]:
    gb = res["bytes"] / 1e9
    sweep = {c: med([sw[str(c)] for sw in res["sweeps"]]) for c in SWEEP}
    best = max(sweep.values())
    lines = [f"\n{name}: {gb:.2f} GB written per save (4 ranks)",
             "  write limit (medians of the sweeps), GB/s: "
             + ", ".join(f"{c} streams {v:.2f}" for c, v in sweep.items())]
    for v, saves in res["saves"].items():
        s = med([x["s"] for x in saves])
        paired = med([gb / x["s"] / x["paired"] for x in saves])
        lines.append(f"  {v}: save median {s:.2f} s (of {len(saves)}) = {gb / s:.2f} GB/s = "
                     f"{gb / s / best:.0%} of the sweeps' best; paired {paired:.0%} (per save: "
                     + ", ".join(f"{gb / x['s'] / x['paired']:.0%}" for x in saves) + ")")
    return lines


def file_timeline(spool: str) -> list[str]:
    """Per save in the telemetry spool: when each rank's last large data file was committed,
    from the save's start, and the longest wait of one file for a host write slot."""
    from telemetry.sinks import read_spool

    events = read_spool(spool)
    saves: list[list[dict[str, Any]]] = []  # the ranks' save spans, grouped by start
    for e in sorted((e for e in events if e["name"] == "save" and e.get("rank") is not None),
                    key=lambda e: e["ts"]):
        if saves and e["ts"] - saves[-1][0]["ts"] < 1.0:
            saves[-1].append(e)
        else:
            saves.append([e])
    commits = [e for e in events if e["name"] == "storage.commit" and e.get("rank") is not None
               and ".safetensors" in str(e.get("path"))
               and ((e.get("attrs") or {}).get("file_bytes") or 0) >= 8 << 20]
    lines = ["  per save: each rank's last large file durable at (s from the save's start); "
             "the longest slot wait"]
    for i, group in enumerate(saves):
        t0 = min(e["ts"] for e in group)
        t1 = max(e["ts"] + e["duration_s"] for e in group)
        mine = [e for e in commits if t0 <= e["ts"] <= t1]
        if not mine:
            continue
        done = {r: max(e["ts"] + e["duration_s"] - t0 for e in mine if e["rank"] == r)
                for r in sorted({e["rank"] for e in mine})}
        wait = max(mine, key=lambda e: (e.get("attrs") or {}).get("slot_wait_s") or 0)
        lines.append(f"    save {i + 1}: " + ", ".join(f"rank {r} {s:.2f}" for r, s in done.items())
                     + f"; spread {max(done.values()) - min(done.values()):.2f} s; slot wait "
                     f"{(wait.get('attrs') or {}).get('slot_wait_s') or 0:.2f} s (rank {wait['rank']})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="medium",
                        help=f"comma-separated: {', '.join(MODELS)}, skew")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME or NAME:ENV=V,ENV=V (repeatable): saves under each environment")
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    parser.add_argument("--files", action="store_true",
                        help="per save, when each rank's files were durable (from telemetry)")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "bcp-bench-write"))
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds the disk is left idle before each timed write")
    args = parser.parse_args()
    os.environ["BENCH_SETTLE_S"] = str(args.settle)  # the spawned ranks read it on import
    root = os.path.abspath(args.dir)
    t = time.perf_counter()
    everything: dict[str, Any] = {}
    for name in args.models.split(","):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        out = f"{root}/res.json"
        spool = os.environ["BCP_TELEMETRY_DIR"] = tempfile.mkdtemp(prefix="bcp-bench-telemetry-")
        mp.start_processes(worker, nprocs=4, start_method="spawn",
                           args=(4, free_port(), name, root, args.reps, out, parse_variants(args.variant)))
        everything[name] = json.load(open(out))
        print("\n".join(report(name, everything[name])), flush=True)
        if args.files:
            print("\n".join(file_timeline(spool)), flush=True)
        shutil.rmtree(spool, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - t:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f)


if __name__ == "__main__":
    main()
