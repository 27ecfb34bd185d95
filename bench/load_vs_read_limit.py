"""Cold loads against the disk's cold parallel-read limit, measured in the same run.

    .venv/bin/python bench/load_vs_read_limit.py                          # 0.36 GB, ~2 min
    .venv/bin/python bench/load_vs_read_limit.py --models 1.3gb,3.56gb --reps 3 --profile
    .venv/bin/python bench/load_vs_read_limit.py --variant before:BCP_LOAD_EARLY=0 --variant after

For each model (``--models``; the GPT + AdamW workloads of bench/train_loop_cost.py), FSDP2
on 4 CPU processes (gloo) saves one checkpoint. Then, ``--reps`` times, with the page cache
dropped and the disk left idle for ``--settle`` seconds (2) before each measurement:
  limit   rank 0 reads the checkpoint's data files (the bytes a load reads) with S parallel
          sequential streams (each a contiguous span; 4 MiB calls, each read page dropped
          once consumed, as the engine reads), landing the bytes in memory as large as the
          checkpoint, touched beforehand (as a load lands them in the model's tensors; the
          disk alone, into a reused 4 MiB buffer, is also shown):
          S = the streams the engine uses (ranks x reader threads per rank), and a sweep of
          1, 2, 4, 8, 16 whose best is the read limit
  load    bcp.load into the same layout (4 ranks), and in 2 fresh processes resharded 4 -> 2
  paired  right before and right after each load, the limit again with the engine's streams
          and with the best count of the sweeps so far (the disk's speed drifts by tens of
          percent within a minute, and a best picked as the maximum of noisy sweeps is biased
          upwards; measured again next to each load it is neither)
and prints load GB/s and its fraction of both limits: medians of the sweeps, and the median
of the paired ratios. The cache is dropped with
/proc/sys/vm/drop_caches where permitted (root), else with posix_fadvise(DONTNEED) on every
file of the checkpoint; the output says which.

``--profile`` adds one instrumented load per layout (not timed with the others): per rank,
the phases, every read request (size, duration, concurrency over the host), checksum
verification and how much of it overlapped reads, copies into targets, the exchange, and
the Python time per box; printed and written as JSON (``--profile-json``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    DROP_CACHES,
    MODELS,
    env_set,
    free_port,
    gather,
    make_fsdp,
    max_over_ranks,
    status_kb,
    sum_over_ranks,
)
from demo.model import GPTConfig, batch, loss_fn  # noqa: E402

READ_CALL = 4 << 20  # bytes per preadv call, as the engine's local backend reads
SWEEP = (1, 2, 4, 8, 16)
METADATA_NAMES = {".metadata", "metadata", "COMMITTED", "latest"}


# -- the disk --------------------------------------------------------------------------------


def data_files(path: str) -> list[tuple[str, int]]:
    """The checkpoint's storage files (what a load reads), largest first, with sizes."""
    out = []
    for d, _, names in os.walk(path):
        for n in names:
            full = os.path.join(d, n)
            if os.path.getsize(full) > 64 << 10:  # metadata and markers are small
                out.append((full, os.path.getsize(full)))
    return sorted(out, key=lambda f: -f[1])


# Seconds the disk is left idle after the cache is dropped, before every timed read (limit
# or load). This VM's disk serves a read that follows a heavy one much slower: 4 streams read
# 3.56 GB at 1.56 GB/s right after another such read, and at 2.46-2.50 GB/s after 1, 2, 4 or
# 8 s idle (medians of 3); 2 streams right after a 1-stream read, 2.45, and right after a
# 4-stream one, 1.62. Without a pause each figure depends on what ran just before it.
SETTLE_S = float(os.environ.get("BENCH_SETTLE_S", "2"))


def drop_cache(files: list[str]) -> str:
    """Drop the page cache, then leave the disk idle for ``SETTLE_S``; returns how."""
    try:
        return _drop(files)
    finally:
        time.sleep(SETTLE_S)


def _drop(files: list[str]) -> str:
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def spans(files: list[tuple[str, int]], streams: int) -> list[list[tuple[str, int, int]]]:
    """The files' bytes, end to end, cut into ``streams`` contiguous spans of equal size;
    each span a list of (file, offset, length)."""
    total = sum(n for _, n in files)
    share = -(-total // streams)
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(streams)]
    pos = 0
    for path, size in files:
        off = 0
        while off < size:
            k = min(pos // share, streams - 1)
            n = min(size - off, (k + 1) * share - pos) if k < streams - 1 else size - off
            out[k].append((path, off, n))
            off, pos = off + n, pos + n
    return out


def read_span(span: list[tuple[str, int, int]], into: memoryview | None) -> int:
    """Read one stream's span in 4 MiB calls into ``into`` (memory of the span's size, as a
    load lands its bytes in the target tensors), or, when None, into one reused 4 MiB buffer
    that stays in the CPU caches (the disk alone: no load can do this)."""
    scratch = memoryview(bytearray(READ_CALL))
    total = 0
    for path, off, n in span:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_SEQUENTIAL)
            done = 0
            while done < n:
                size = min(READ_CALL, n - done)
                dest = scratch[:size] if into is None else into[total + done : total + done + size]
                got = os.preadv(fd, [dest], off + done)
                if got == 0:
                    break
                # Consumed pages dropped, as the engine's reads drop them: here that alone
                # takes 4 streams from 1.38 to 2.25 GB/s (medians of 4, 3.56 GB).
                os.posix_fadvise(fd, off + done, got, os.POSIX_FADV_DONTNEED)
                done += got
            total += done
        finally:
            os.close(fd)
    return total


_DEST: list[torch.Tensor] = []


def destination(nbytes: int) -> memoryview:
    """Memory for every byte of the checkpoint, allocated and touched once (outside any
    timing), as a model's tensors are before a load."""
    if not _DEST or _DEST[0].numel() < nbytes:
        _DEST[:] = [torch.ones(nbytes, dtype=torch.uint8)]
    return memoryview(_DEST[0].numpy())[:nbytes]


def read_limit(files: list[tuple[str, int]], streams: int, into_memory: bool = True) -> tuple[float, str]:
    """Cold parallel sequential read of ``files`` with ``streams`` threads: GB/s, and how
    the cache was dropped. ``into_memory``: each stream lands its bytes in its own part of
    memory as large as the checkpoint (what a load must do), else in a reused 4 MiB buffer."""
    parts = spans(files, streams)
    into: list[memoryview | None] = [None] * len(parts)
    if into_memory:
        dest, start = destination(sum(n for _, n in files)), 0
        for i, part in enumerate(parts):
            size = sum(n for _, _, n in part)
            into[i], start = dest[start : start + size], start + size
    how = drop_cache([p for p, _ in files])
    t = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        total = sum(pool.map(read_span, parts, into))
    return total / (time.perf_counter() - t) / 1e9, how


# -- the processes ---------------------------------------------------------------------------



def release_memory() -> None:
    """Release staging buffers and the C heap's free pages: memory is measured from here."""
    from bytecheckpoint.engine import staging

    release = getattr(staging, "release_pools", None)
    if release is not None:
        release()
    else:
        staging._POOLS.clear()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def make_state(cfg: GPTConfig, seed: int) -> dict[str, Any]:
    model, optim = make_fsdp(cfg, seed)
    inputs, targets = batch(cfg, seed, dist.get_rank(), size=1)
    loss_fn(model, inputs[:, :8], targets[:, :8]).backward()  # AdamW state exists
    optim.step()
    optim.zero_grad()
    return {"model": model, "optimizer": optim}


def saved_state(rank: int, world: int, port: int, model: str, path: str) -> dict[str, Any]:
    """Join the 4 ranks' gloo group, build the FSDP2 state of ``model`` and save it to
    ``path``: what the load benchmarks start from."""
    import bytecheckpoint as bcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=30))
    state = make_state(MODELS[model], seed=0)
    bcp.save(path, state, framework="fsdp2")
    dist.barrier()
    return state


def cold_load(state: dict[str, Any], path: str, files: list[tuple[str, int]]) -> dict[str, float]:
    import bytecheckpoint as bcp

    dist.barrier()
    if dist.get_rank() == 0:
        drop_cache([p for p, _ in files])
    release_memory()
    rss0 = status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")
    dist.barrier()
    t = time.perf_counter()
    result = bcp.load(path, state, framework="fsdp2")
    elapsed = max_over_ranks(time.perf_counter() - t)
    peak = max_over_ranks(status_kb("VmHWM") - rss0)
    return {"s": elapsed, "bytes": sum_over_ranks(result.bytes_read), "mem_kb": peak}


def limits(files: list[tuple[str, int]], engine_streams: int, sweep: bool) -> dict[str, Any]:
    """Rank 0 reads; the others wait (so nothing else of ours touches the disk)."""
    out: dict[str, Any] = {}
    if dist.get_rank() == 0:
        counts = sorted({engine_streams, *SWEEP}) if sweep else [engine_streams]
        for s in counts:
            out[s], out["how"] = read_limit(files, s)
        out["scratch"] = read_limit(files, engine_streams, into_memory=False)[0]
    dist.barrier()
    return out


def best_count(sweeps: list[dict[str, Any]]) -> int:
    """The stream count with the highest median over the sweeps so far."""
    counts = sorted({int(k) for sw in sweeps for k in sw if k not in ("how", "scratch")})
    return max(counts, key=lambda c: med([sw[c] if c in sw else sw[str(c)] for sw in sweeps]))


def around(files: list[tuple[str, int]], counts: list[int]) -> dict[int, float]:
    """The limit at each of ``counts`` streams, read by rank 0 now (the others wait)."""
    out: dict[int, float] = {}
    if dist.get_rank() == 0:
        for c in counts:
            out[c] = read_limit(files, c)[0]
    dist.barrier()
    return out


def paired_load(variant: dict[str, str], state: dict[str, Any], path: str,
                files: list[tuple[str, int]], counts: list[int]) -> dict[str, Any]:
    """A cold load with the limit at ``counts`` streams measured right before and right after
    it (in mirrored order); ``paired[c]`` is the mean of the two."""
    before = around(files, counts)
    load = cold_load_as(variant, state, path, files)
    after = around(files, counts[::-1])
    load["paired"] = {c: (before[c] + after[c]) / 2 for c in before}
    return load


def parse_variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """``NAME`` or ``NAME:ENV=V,ENV=V`` -> {name: environment}; loads alternate between them."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        name, _, env = spec.partition(":")
        out[name] = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    return out or {"default": {}}


def cold_load_as(variant: dict[str, str], state: dict[str, Any], path: str,
                 files: list[tuple[str, int]]) -> dict[str, float]:
    with env_set(variant):
        return cold_load(state, path, files)


def worker(rank: int, world: int, port: int, cfg: GPTConfig, path: str, reps: int, save: bool,
           profile: bool, out_file: str, variants: dict[str, dict[str, str]]) -> None:
    import bytecheckpoint as bcp
    import bytecheckpoint.api  # noqa: F401  (bcp.load imports it on first use: 0.02-0.04 s, not the load's)
    from bytecheckpoint.engine.load import share_of_host

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=30))
    state = make_state(cfg, seed=0 if save else 1)
    if save:
        bcp.save(path, state, framework="fsdp2")
    dist.barrier()
    files = data_files(path)
    engine_streams = world * share_of_host(world)
    res: dict[str, Any] = {"limits": [], "loads": {v: [] for v in variants}, "engine_streams": engine_streams,
                           "bytes": sum(n for _, n in files), "files": len(files)}
    names = list(variants)
    for rep in range(reps):
        # the order alternates: limit first, then loads; then loads first; variants rotate
        first_load = rep % 2 == 1
        order = names[rep % len(names):] + names[:rep % len(names)]
        if not first_load or not res["limits"]:
            res["limits"].append(limits(files, engine_streams, sweep=True))
        best = gather(best_count(res["limits"]) if rank == 0 else 0)[0]  # rank 0 measured it
        counts = sorted({engine_streams, best}, reverse=rep % 2 == 1)
        for v in order:
            res["loads"][v].append(paired_load(variants[v], state, path, files, counts))
        if first_load and len(res["limits"]) <= rep:
            res["limits"].append(limits(files, engine_streams, sweep=True))
        if rank == 0:
            print(f"  world {world}, rep {rep + 1}/{reps}: load "
                  + ", ".join(f"{v} {res['loads'][v][-1]['s']:.2f} s" for v in names), flush=True)
    if profile:
        res["profile"] = profiled_load(state, path, files)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(res, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


# -- profile of one load ---------------------------------------------------------------------


class Recorder:
    """Wraps functions with timers that record (start, end, bytes, thread name) per call."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[float, float, int, str]]] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()

    def wrap(self, owner: Any, name: str, label: str, size: Any = None) -> None:
        original = getattr(owner, name)
        calls = self.calls.setdefault(label, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                n = size(args, kwargs) if size is not None else 0
                with self._lock:
                    calls.append((t, time.perf_counter(), n, threading.current_thread().name))

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def covered(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Seconds of ``intervals`` that lie inside the union ``cover``."""
    total = 0.0
    for a, b in intervals:
        for c, d in cover:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def by_thread(reads: list[tuple[float, float, int, str]], t0: float) -> dict[str, dict[str, float]]:
    """Reads per kind of thread (the name without its number): bytes, busy seconds, and when
    the first began and the last ended, from the load's start."""
    out: dict[str, dict[str, float]] = {}
    for a, b, n, name in reads:
        kind = name.rstrip("0123456789_").rstrip("-") or name
        k = out.setdefault(kind, {"bytes": 0, "busy_s": 0.0, "first_s": a - t0, "last_s": b - t0})
        k["bytes"] += n
        k["busy_s"] += b - a
        k["first_s"], k["last_s"] = min(k["first_s"], a - t0), max(k["last_s"], b - t0)
    return out


def concurrency(intervals: list[tuple[float, float]]) -> dict[str, float]:
    """Time-weighted concurrency of intervals while at least one runs: mean and max."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    level, last, busy, weighted, peak = 0, None, 0.0, 0.0, 0
    for t, d in events:
        if last is not None and level > 0:
            busy += t - last
            weighted += level * (t - last)
        level += d
        peak = max(peak, level)
        last = t
    return {"mean": weighted / busy if busy else 0.0, "max": float(peak), "busy_s": busy}


def profiled_load(state: dict[str, Any], path: str, files: list[tuple[str, int]]) -> dict[str, Any]:
    import cProfile
    import io
    import pstats

    import bytecheckpoint as bcp
    from bytecheckpoint.engine import load as load_mod
    from bytecheckpoint.engine import load_pipeline
    from bytecheckpoint.runtime.comm import Communicator

    rec = Recorder()
    plan_steps = ("_open_checkpoint", "flatten_state", "get_planner", "check_coverage", "check_file_sizes",
                  "_exchange_device", "_check_keys", "plan_reads", "_check_unchanged")
    for name in plan_steps:  # the planning phase, step by step
        if hasattr(load_mod, name):
            rec.wrap(load_mod, name, name)
    rec.wrap(Communicator, "all_gather", "all_gather")
    rec.wrap(os, "preadv", "read", lambda a, k: sum(len(b) for b in a[1]))
    rec.wrap(load_pipeline, "bad_chunks", "verify", lambda a, k: len(a[0]))
    rec.wrap(load_pipeline, "copy_out", "copy", lambda a, k: a[0].hi - a[0].lo if a[0].box else 0)
    rec.wrap(load_pipeline.LoadPipeline, "_exchange", "exchange")
    rec.wrap(load_pipeline.LoadPipeline, "_agree", "agree")
    rec.wrap(load_pipeline.LoadPipeline, "_allocate", "allocate")
    dist.barrier()
    if dist.get_rank() == 0:
        drop_cache([p for p, _ in files])
    dist.barrier()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        result = bcp.load(path, state, framework="fsdp2")
    finally:
        prof.disable()
        rec.restore()
    t1 = time.perf_counter()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    reads = rec.calls["read"]
    read_union = union([(a, b) for a, b, _, _ in reads])
    verify = [(a, b) for a, b, _, _ in rec.calls["verify"]]
    sizes = sorted(n for _, _, n, _ in reads)
    mine = {
        "wall_s": t1 - t0,
        "phases": result.phases,
        "boxes": len(getattr(result, "boxes", [])) or None,
        "read": {"calls": len(reads), "bytes": sum(sizes), "busy_s": sum(b - a for a, b in read_union),
                 "threads": len({t for *_, t in reads}),
                 "size_median": statistics.median(sizes) if sizes else 0,
                 "size_min": sizes[0] if sizes else 0, "size_max": sizes[-1] if sizes else 0},
        "intervals": [(a, b) for a, b, _, _ in reads],
        "by_thread": by_thread(reads, t0),
        # when this rank's first tensor read (>= 4 MiB) began, and its last ended, from the load's start
        "first_read_s": min((a for a, _, n, _ in reads if n >= READ_CALL), default=t1) - t0,
        "last_read_s": max((b for _, b, _, _ in reads), default=t1) - t0,
        "main_thread_top": text.getvalue(),
    }
    mine["plan_steps"] = {k: sum(b - a for a, b, _, _ in rec.calls.get(k, [])) for k in
                          (*plan_steps, "all_gather")}
    for label in ("verify", "copy", "exchange", "agree", "allocate"):
        calls = rec.calls[label]
        mine[label] = {"calls": len(calls), "s": sum(b - a for a, b, _, _ in calls),
                       "bytes": sum(n for _, _, n, _ in calls)}
    mine["verify"]["overlapped_reads_s"] = covered(verify, read_union)
    everyone = gather(mine)
    host_reads = [iv for r in everyone for iv in r["intervals"]]
    for r in everyone:
        del r["intervals"]
    return {"ranks": everyone, "host_read_concurrency": concurrency(host_reads),
            "host_read_busy_s": sum(b - a for a, b in union(host_reads))}


# -- driver ----------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report_layout(name: str, res: dict[str, Any]) -> list[str]:
    gb = res["bytes"] / 1e9
    counts = sorted({int(k) for lim in res["limits"] for k in lim if k not in ("how", "scratch")})
    per_s = {s: med([lim[str(s)] if str(s) in lim else lim[s] for lim in res["limits"]]) for s in counts}
    best_s = max(per_s, key=lambda s: per_s[s])
    eng = res["engine_streams"]
    lines = [f"  {name}: {gb:.2f} GB in {res['files']} files",
             "    read limit, GB/s by streams: " + ", ".join(f"{s}: {v:.2f}" for s, v in per_s.items())
             + f"; the disk alone ({eng} streams into one reused 4 MiB buffer each, no load's "
             f"landing in memory): {med([lim['scratch'] for lim in res['limits'] if 'scratch' in lim]):.2f}"]
    for variant, loads in res["loads"].items():
        load_gbps = med([x["bytes"] / x["s"] / 1e9 for x in loads])
        lines.append(
            f"    {variant}: cold load median {med([x['s'] for x in loads]):.2f} s (of {len(loads)}) = "
            f"{load_gbps:.2f} GB/s; / limit with the engine's {eng} streams: {load_gbps / per_s[eng]:.0%}; "
            f"/ best ({best_s} streams): {load_gbps / per_s[best_s]:.0%}; peak extra host memory per "
            f"rank {med([x['mem_kb'] for x in loads]) / 1024:.0f} MB")
        lines.append(f"      paired, load / the limit measured right before and after it (median of "
                     f"{len(loads)}): " + paired_summary(loads, eng))
    return lines


def paired_summary(loads: list[dict[str, Any]], engine_streams: int) -> str:
    """Median over loads of load GB/s / the limit measured around that load, per stream count
    (the best count is the sweeps' best when that load ran)."""
    ratios: dict[str, list[float]] = {}
    for x in loads:
        paired = {int(c): v for c, v in x.get("paired", {}).items()}
        gbps = x["bytes"] / x["s"] / 1e9
        for c, v in paired.items():
            ratios.setdefault("engine" if c == engine_streams else "other", []).append(gbps / v)
        ratios.setdefault("best", []).append(gbps / max(paired.values()) if paired else float("nan"))
    parts = [f"at {engine_streams} streams {med(ratios.get('engine', [])):.0%}"]
    if "other" in ratios:
        parts.append(f"at the sweeps' best count {med(ratios['other']):.0%}")
        parts.append(f"at the faster of the two {med(ratios['best']):.0%}")
    return "; ".join(parts)


def report_profile(name: str, prof: dict[str, Any]) -> list[str]:
    c = prof["host_read_concurrency"]
    lines = [f"  profile, {name}: host read concurrency mean {c['mean']:.1f}, max {c['max']:.0f}; disk "
             f"busy (some read in flight) {prof['host_read_busy_s']:.2f} s"]
    for rank, r in enumerate(prof["ranks"]):
        rd = r["read"]
        lines.append(
            f"    rank {rank}: wall {r['wall_s']:.2f} s, reads from {r['first_read_s']:.2f} to "
            f"{r['last_read_s']:.2f} s, phases "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
            + f"; reads {rd['calls']} calls on {rd['threads']} threads, median "
            f"{rd['size_median'] / 2**20:.1f} MiB ({rd['size_min'] / 2**20:.2f}-"
            f"{rd['size_max'] / 2**20:.1f}), busy {rd['busy_s']:.2f} s; "
            f"verify {r['verify']['s']:.2f} s ({r['verify']['overlapped_reads_s']:.2f} s while reads ran); "
            f"copy {r['copy']['s']:.2f} s ({r['copy']['calls']} boxes); exchange {r['exchange']['s']:.2f} s; "
            f"agree {r['agree']['s']:.2f} s; allocate {r['allocate']['s']:.2f} s; planning steps: "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["plan_steps"].items() if v))
        lines.append("      reads by thread: " + "; ".join(
            f"{k} {v['bytes'] / 1e6:.0f} MB, busy {v['busy_s']:.2f} s, {v['first_s']:.2f}-{v['last_s']:.2f} s"
            for k, v in sorted(r.get("by_thread", {}).items())))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="medium", help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="one instrumented load per layout")
    parser.add_argument("--profile-json", default=None)
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME or NAME:ENV=V,ENV=V (repeatable): loads under each environment, "
                        "side by side, e.g. --variant before:BCP_LOAD_EARLY=0 --variant after")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "bcp-bench-read"))
    parser.add_argument("--settle", type=float, default=SETTLE_S,
                        help="seconds the disk is left idle before each timed read (see SETTLE_S)")
    args = parser.parse_args()
    os.environ["BENCH_SETTLE_S"] = str(args.settle)  # the spawned ranks read it on import
    root = os.path.abspath(args.dir)
    t = time.perf_counter()
    print(f"load average {open('/proc/loadavg').read().strip()}; the machine is shared; "
          f"{args.settle:g} s idle before each timed read", flush=True)
    everything: dict[str, Any] = {}
    for name in args.models.split(","):
        cfg = MODELS[name]
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        path = f"{root}/ckpt"
        runs = {}
        for world, save in ((4, True), (2, False)):
            out = f"{root}/w{world}.json"
            mp.start_processes(worker, nprocs=world, start_method="spawn",
                               args=(world, free_port(), cfg, path, args.reps, save, args.profile, out,
                                     parse_variants(args.variant)))
            runs[f"4->{world}"] = json.load(open(out))
        everything[name] = runs
        how = runs["4->4"]["limits"][0]["how"]
        print(f"\n{name} (page cache dropped by {how}; 4 ranks saved it):")
        for layout, res in runs.items():
            print("\n".join(report_layout(layout, res)))
        if args.profile:
            for layout, res in runs.items():
                print("\n".join(report_profile(layout, res["profile"])))
                print("    main thread of rank 0, top functions by own time:")
                print("\n".join("      " + line for line in
                                res["profile"]["ranks"][0]["main_thread_top"].splitlines()[6:22]))
        shutil.rmtree(root, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - t:.0f}s; load average after "
          f"{open('/proc/loadavg').read().strip()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f)
    if args.profile_json:
        with open(args.profile_json, "w") as f:
            json.dump({n: {k: v.get("profile") for k, v in r.items()} for n, r in everything.items()}, f)


if __name__ == "__main__":
    main()
