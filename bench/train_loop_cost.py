"""The training-loop cost of a checkpoint: bytecheckpoint against PyTorch DCP, in one run.

    .venv/bin/python bench/train_loop_cost.py                        # ~84 MB state, 2-3 min
    .venv/bin/python bench/train_loop_cost.py --model 1.3gb --every 4 --steps 24
    .venv/bin/python bench/train_loop_cost.py --model 3.56gb --every 4 --steps 24
    .venv/bin/python bench/train_loop_cost.py --modes ours-blocking,dcp-async --json out.json

A GPT-style model with AdamW (the workloads of bench/engine_vs_dcp.py; ``--model``: small
84 MB of state, medium 0.36 GB, 1.3gb, 3.56gb) under FSDP2 on 4 CPU processes (gloo) trains
``--steps`` steps with a save after every ``--every``-th step, once per mode, and once with
no saves (the baseline, in the same processes, the order rotating per repetition). Each mode
first makes one untimed save (staging memory is allocated then). Modes (``--modes``):

  ours-blocking     bcp.save(async_save=True, snapshot="blocking"): returns once this rank's
                    shards are copied
  ours-sync         bcp.save()
  ours-overlapped   bcp.save(async_save=True, snapshot="overlapped"): returns once scheduled;
                    the copy overlaps the next step, the optimizer step waits for it
  ours-overlapped-arena
                    the same through the staging arena (BCP_SNAPSHOT_WRITE_THROUGH=0): host
                    tensors are otherwise written straight from the live tensors
  ours-overlapped-cap64, ours-blocking-cap64
                    the same with staging_max_bytes=64 MiB: the copy runs in rounds
                    through a bounded arena, each waiting for the writer to drain the last
  dcp-async         dcp.async_save with its default stager (copies, then returns)
  dcp-async-staged  dcp.async_save with DefaultStager(use_async_staging=True), reused across
                    saves: returns at once; by DCP's contract the loop waits for its
                    staging_completion before the next optimizer step (CPU: no pinned or
                    non-blocking copies, which need an accelerator)
  dcp-sync          dcp.save
A mode is a row of MODES: a system and the keyword arguments of its save call, so a new
save option is measured by adding a row (or ``--extra-mode NAME=SYSTEM:JSON``).

Per checkpoint (medians over the timed saves, each the maximum over ranks):
  return     time until save() returns
  extra      extra training-loop wall time: from the save call to the end of the first step
             that ends after the save is seen complete, minus those steps' time without saves
             (the median step of the loop with no saves)
  extra (own)
             the same against the median step of the same loop outside every save's window
             (at least 2 such steps per rank, else the loop with no saves): loops of different
             modes run minutes apart, and a drift of the shared machine's speed between them
             moves "extra" by (drift x steps in a window), of the order of the figure itself
  rate       training steps/s while the save is in flight (overlap of steps with it)
  total      save call to commit (for ETTR)
  cpu        the save's process CPU time (user + system: copies, checksums, write), summed
             over ranks, from saves made with training stopped; cpu / cores is the floor of
             the extra loop time where training keeps every core busy
  mem        peak extra host memory per rank during a save (staging included), over the RSS
             before it with every staging buffer released
and ETTR (ByteCheckpoint paper, appendix "average ETTR"): with T_wasted = (I + T_save) / 2 +
T_load for one failure per checkpoint interval I, ETTR = I / (I + extra + T_wasted), for a
save every 30 and every 5 minutes, T_load a cold load of the same checkpoint.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import DROP_CACHES, MODELS, drop_caches, env_set, free_port, gather, make_fsdp, status_kb  # noqa: E402
from demo.model import GPT, GPTConfig, batch, loss_fn  # noqa: E402

WORLD = 4


@dataclass(frozen=True)
class Mode:
    """One way to save: ``system`` ("bcp" or "dcp") and the keyword arguments of its call.
    For dcp, ``async`` picks async_save and ``stager`` "async" a reused DefaultStager."""

    system: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # settings around each save call


MODES: dict[str, Mode] = {
    "ours-blocking": Mode("bcp", {"async_save": True, "snapshot": "blocking"}),
    "ours-sync": Mode("bcp", {}),
    "ours-overlapped": Mode("bcp", {"async_save": True, "snapshot": "overlapped"}),
    # The staging arena bounded at 64 MiB per rank (BCP_STAGING_MAX_BYTES): copies in rounds
    # that wait for the writer; the memory column shows the bound, extra/return its price.
    # The overlapped snapshot through the staging arena: a copy first, then the write (CPU
    # tensors otherwise write straight from the live tensors; engine/write_through.py).
    "ours-overlapped-arena": Mode("bcp", {"async_save": True, "snapshot": "overlapped"},
                                  env={"BCP_SNAPSHOT_WRITE_THROUGH": "0"}),
    # Written through with writes that never wait for writeback (BCP_STORAGE_DROP_BEHIND=0)
    "ours-overlapped-nodrop": Mode("bcp", {"async_save": True, "snapshot": "overlapped"},
                                   env={"BCP_STORAGE_DROP_BEHIND": "0"}),
    # Written through the page cache only: no direct writes (BCP_STORAGE_DIRECT_WRITES=0)
    "ours-overlapped-buffered": Mode("bcp", {"async_save": True, "snapshot": "overlapped"},
                                     env={"BCP_STORAGE_DIRECT_WRITES": "0"}),
    "ours-overlapped-cap64": Mode("bcp", {"async_save": True, "snapshot": "overlapped",
                                          "staging_max_bytes": 64 << 20}),
    "ours-blocking-cap64": Mode("bcp", {"async_save": True, "snapshot": "blocking",
                                        "staging_max_bytes": 64 << 20}),
    "dcp-async": Mode("dcp", {"async": True}),
    # the writer's pinned copy allocated once and reused (an accelerator only)
    "dcp-async-cached": Mode("dcp", {"async": True, "cache": True}),
    "dcp-async-staged": Mode("dcp", {"async": True, "stager": "async"}),
    "dcp-sync": Mode("dcp", {}),
}
DEFAULT_MODES = "ours-overlapped,ours-blocking,ours-sync,dcp-async,dcp-async-staged,dcp-sync"
PAIRS = (("ours-overlapped", "dcp-async"), ("ours-overlapped", "dcp-async-staged"),
         ("ours-overlapped-arena", "dcp-async"), ("ours-overlapped", "ours-overlapped-arena"),
         ("ours-blocking", "dcp-async"), ("ours-blocking", "dcp-async-staged"), ("ours-sync", "dcp-sync"),
         ("ours-overlapped-cap64", "ours-overlapped"), ("ours-blocking-cap64", "ours-blocking"),
         ("ours-overlapped-cap64", "dcp-async"), ("ours-overlapped-buffered", "dcp-async"),
         ("ours-overlapped", "ours-overlapped-buffered"))


# -- per-process helpers ---------------------------------------------------------------------



def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: ``5`` into clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime



def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, cfg: GPTConfig, step: int,
               tokens: int, before_step: Any = None) -> None:
    inputs, targets = batch(cfg, step, dist.get_rank(), size=1)
    loss_fn(model, inputs[:, :tokens], targets[:, :tokens]).backward()
    if before_step is not None:
        before_step()
    optim.step()
    optim.zero_grad()


def release_staging() -> None:
    """Drop every host buffer a save or load keeps for the next one, so memory is measured
    from the same start for every mode."""
    try:
        from bytecheckpoint.engine import staging
    except ImportError:
        return
    release = getattr(staging, "release_pools", None)
    if release is not None:
        release()
    else:  # before release_pools existed
        staging._POOLS.clear()
    trim_heap()


def trim_heap() -> None:
    """Collect garbage and give the C heap's free pages back to the system, so RSS counts
    what is held, not what malloc keeps for reuse (copies below its mmap threshold)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# -- the systems -----------------------------------------------------------------------------


class Pending:
    """A save in flight: ``done()``, ``wait()``, ``finished_at`` (perf_counter of its end,
    once known) and ``before_step`` (what the loop must call before the optimizer step)."""

    def __init__(self, handle: Any, t_call: float, finished_at: float | None = None,
                 before_step: Any = None) -> None:
        self.handle, self.t_call, self.finished_at = handle, t_call, finished_at
        self.before_step = before_step
        self.ret = t_call  # when save() returned

    def done(self) -> bool:
        return self.finished_at is not None or self.handle.done()

    def wait(self) -> None:
        if self.finished_at is None:
            self._wait()

    def _wait(self) -> None:
        raise NotImplementedError


class BcpPending(Pending):
    result: Any = None  # the SaveResult, once waited for

    def _wait(self) -> None:
        self.result = self.handle.wait()
        self.finished_at = self.t_call + self.result.duration_s

    def done(self) -> bool:
        if self.finished_at is None and self.handle.done():
            self._wait()
        return self.finished_at is not None


class DcpPending(Pending):
    def __init__(self, future: Any, t_call: float, before_step: Any = None) -> None:
        super().__init__(future, t_call, None, before_step)
        self._end: list[float] = []
        future.add_done_callback(lambda _f: self._end.append(time.perf_counter()))

    def done(self) -> bool:
        if self.handle.done():
            self._wait()
        return self.finished_at is not None

    def _wait(self) -> None:
        self.handle.result()
        while not self._end:  # the callback runs right after the result is set
            time.sleep(0.001)
        self.finished_at = self._end[0]


class Bcp:
    def __init__(self, model: Any, optim: Any, kwargs: dict[str, Any]) -> None:
        self.state = {"model": model, "optimizer": optim}
        self.kwargs = kwargs
        self.env: dict[str, str] = {}

    def save(self, path: str, step: int) -> Pending:
        import bytecheckpoint as bcp

        with env_set(self.env):
            t = time.perf_counter()
            out = bcp.save(path, self.state, framework="fsdp2", step=step, **self.kwargs)
        if hasattr(out, "wait"):
            return BcpPending(out, t)
        return Pending(out, t, finished_at=time.perf_counter())

    def load(self, path: str) -> None:
        import bytecheckpoint as bcp

        bcp.load(path, self.state, framework="fsdp2")

    def reset_staging(self) -> None:
        release_staging()

    def close(self) -> None:
        pass


class Dcp:
    def __init__(self, model: Any, optim: Any, kwargs: dict[str, Any]) -> None:
        self.model, self.optim = model, optim
        self.is_async = bool(kwargs.get("async"))
        self.staged = kwargs.get("stager") == "async"
        self.cache = bool(kwargs.get("cache"))
        # pinned memory and non-blocking copies need an accelerator; shared memory is for
        # the process-based checkpointer
        self.accelerated = next(model.parameters()).is_cuda
        self.stager: Any = None
        self.reset_staging()
        # async_save finishes its collectives on a background thread: on the training group
        # they would deadlock with FSDP's own (DCP's docs ask for a separate gloo group).
        self.group = dist.new_group(backend="gloo")

    def _sd(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def save(self, path: str, step: int) -> Pending:
        import torch.distributed.checkpoint as dcp

        t = time.perf_counter()
        writer = dcp.FileSystemWriter(path, sync_files=True, cache_staged_state_dict=self.cache)
        if not self.is_async:
            dcp.save(self._sd(), storage_writer=writer)
            return Pending(None, t, finished_at=time.perf_counter())
        out = dcp.async_save(self._sd(), storage_writer=writer, process_group=self.group,
                             async_stager=self.stager)
        if hasattr(out, "upload_completion"):  # AsyncSaveResponse: staging may still run
            staging = out.staging_completion
            return DcpPending(out.upload_completion, t, before_step=staging.result)
        return DcpPending(out, t)

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sd = self._sd()
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def reset_staging(self) -> None:
        """A fresh stager: the old one's cached copies are released."""
        self.close()
        if self.staged:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = self.accelerated
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                       use_async_staging=True, use_non_blocking_copy=gpu))

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        trim_heap()


def make_system(mode: Mode, model: Any, optim: Any) -> Bcp | Dcp:
    system = (Bcp if mode.system == "bcp" else Dcp)(model, optim, dict(mode.kwargs))
    system.env = dict(mode.env)
    return system


# -- one loop --------------------------------------------------------------------------------


def run_loop(system: Bcp | Dcp | None, model: Any, optim: Any, cfg: GPTConfig, root: str,
             steps: int, every: int, tokens: int, first_step: int, settle: int = 1) -> dict[str, Any]:
    """``steps`` steps, a save after every ``every``-th (none when ``system`` is None), after
    ``settle`` untimed steps. Returns this rank's step intervals and, per save, its timestamps."""
    # In one 3.56 GB run the first two steps of the first loop, right after every mode's
    # warm-up save, ran 24% and 44% slower than the loop's other steps; untimed, such steps
    # no longer count against whichever mode happens to run first.
    for k in range(settle):
        train_step(model, optim, cfg, first_step - settle + k, tokens)
    step_spans: list[tuple[float, float]] = []
    saves: list[dict[str, float]] = []
    pending: Pending | None = None
    observed: float | None = None
    dist.barrier()
    t_start = time.perf_counter()

    def close_window(p: Pending, at: float) -> None:
        saves.append({"call": p.t_call, "ret": p.ret, "seen": at, "end": p.finished_at or at})

    for i in range(steps):
        s0 = time.perf_counter()
        hook = pending.before_step if pending is not None and not pending.done() else None
        train_step(model, optim, cfg, first_step + i, tokens, hook)
        s1 = time.perf_counter()
        step_spans.append((s0, s1))
        if pending is not None and observed is None and pending.done():
            observed = s1
            close_window(pending, observed)
        if system is not None and (i + 1) % every == 0:
            if pending is not None and observed is None:  # the previous save is still running
                pending.wait()
                close_window(pending, time.perf_counter())
            pending = system.save(f"{root}/s{first_step + i}", first_step + i)
            pending.ret = time.perf_counter()
            observed = None
            if pending.done():  # a synchronous save
                observed = pending.ret
                close_window(pending, observed)
    if pending is not None and observed is None:
        pending.wait()
        close_window(pending, time.perf_counter())
    return {"loop": time.perf_counter() - t_start, "steps": step_spans, "saves": saves}


def window_figures(ranks: list[dict[str, Any]], base_step: float) -> list[dict[str, float]]:
    """Per save, the maximum over ranks of each figure (see the module docstring)."""
    out = []
    for k in range(len(ranks[0]["saves"])):
        per_rank = []
        for r in ranks:
            s = r["saves"][k]
            inside = [b - a for a, b in r["steps"] if a >= s["call"] and b <= s["seen"] + 1e-9]
            extra = (s["seen"] - s["call"]) - len(inside) * base_step
            flight = max(1e-9, s["end"] - s["call"])
            overlap = sum(max(0.0, min(b, s["end"]) - max(a, s["call"])) / (b - a) for a, b in r["steps"])
            per_rank.append({"return": s["ret"] - s["call"], "extra": extra, "total": s["end"] - s["call"],
                             "rate": overlap / flight})
        out.append({k2: (min if k2 == "rate" else max)(p[k2] for p in per_rank) for k2 in per_rank[0]})
    return out


def own_base(loop: list[dict[str, Any]]) -> float | None:
    """The median step of one loop (every rank's record of it) outside every save's window,
    from call to seen; None with fewer than 2 such steps per rank."""
    steps = []
    for r in loop:
        windows = [(s["call"], s["seen"]) for s in r["saves"]]
        steps += [b - a for a, b in r["steps"]
                  if all(b <= call + 1e-9 or a >= seen - 1e-9 for call, seen in windows)]
    return statistics.median(steps) if len(steps) >= 2 * len(loop) else None


def alone(system: Bcp | Dcp, root: str, reps: int) -> dict[str, float]:
    """Saves with training stopped: CPU time of the save and peak extra host memory, from a
    start where every staging buffer is released."""
    system.reset_staging()
    release_staging()
    dist.barrier()
    rss0 = status_kb("VmRSS")
    reset_peak_rss()
    cpus = []
    for k in range(reps):
        dist.barrier()
        c0 = cpu_s()
        system.save(f"{root}/alone{k}", 10_000 + k).wait()
        cpus.append(cpu_s() - c0)
        dist.barrier()
    peak = status_kb("VmHWM") - rss0
    return {"cpu": statistics.median(cpus[1:] or cpus), "mem_kb": peak}


def rmtree(path: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def worker(rank: int, world: int, port: int, cfg: GPTConfig, modes: dict[str, Mode], args: Any,
           out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=30))
    model, optim = make_fsdp(cfg)
    root = args.dir
    for i in range(2):  # optimizer state exists, allocator warm
        train_step(model, optim, cfg, i, args.tokens)
    systems = {name: make_system(m, model, optim) for name, m in modes.items()}
    for name, s in systems.items():  # first save of each: allocates its staging memory
        s.save(f"{root}/{name}/warmup", 0).wait()
        rmtree(f"{root}/{name}")
    raw: dict[str, list[Any]] = {name: [] for name in [*systems, "none"]}
    names = [*systems, "none"]
    step = 10
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            res = run_loop(systems.get(name), model, optim, cfg, f"{root}/{name}", args.steps,
                           args.every, args.tokens, step, args.settle_steps)
            step += args.steps
            raw[name].append(gather(res))
            rmtree(f"{root}/{name}")
            if rank == 0:
                print(f"  rep {rep + 1}/{args.reps}: {name} loop {res['loop']:.1f}s", flush=True)
    out: dict[str, Any] = {"alone": {}, "load": {}, "raw": raw}
    for name, s in systems.items():
        figs = alone(s, f"{root}/{name}", args.alone_reps)
        out["alone"][name] = gather(figs)
        system = modes[name].system
        if system not in out["load"]:  # T_load for ETTR: one cold load of each format
            s.save(f"{root}/{name}/ckpt", 20_000).wait()
            dist.barrier()
            if rank == 0:
                drop_caches()
            dist.barrier()
            t = time.perf_counter()
            s.load(f"{root}/{name}/ckpt")
            out["load"][system] = max(gather(time.perf_counter() - t))
        rmtree(f"{root}/{name}")
        s.close()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(out, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown (a peer that already left can hang it)


# -- report ----------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ettr(interval_s: float, extra_s: float, save_s: float, load_s: float) -> float:
    """The paper's average ETTR: one failure per interval, uniformly placed in it."""
    wasted = 0.5 * (interval_s + extra_s + save_s) + load_s
    return interval_s / (interval_s + extra_s + wasted)


def summarize(data: dict[str, Any], cores: int) -> dict[str, dict[str, float]]:
    base_steps = [b - a for loop in data["raw"]["none"] for r in loop for a, b in r["steps"]]
    base = med(base_steps)
    base_loop = med([max(r["loop"] for r in loop) for loop in data["raw"]["none"]])
    rows: dict[str, dict[str, float]] = {"none": {"step_s": base, "loop_s": base_loop}}
    for name, loops in data["raw"].items():
        if name == "none":
            continue
        figs = [f for loop in loops for f in window_figures(loop, base)]
        own_bases = [own_base(loop) for loop in loops]
        own = [f for loop, b in zip(loops, own_bases) for f in window_figures(loop, base if b is None else b)]
        n_saves = sum(len(loop[0]["saves"]) for loop in loops)
        loop_extra = (sum(max(r["loop"] for r in loop) for loop in loops) - len(loops) * base_loop) / n_saves
        alone = data["alone"][name]
        rows[name] = {
            "saves": len(figs),
            "return": med([f["return"] for f in figs]),
            "extra": med([f["extra"] for f in figs]),
            "extra_own": med([f["extra"] for f in own]),
            "own_base": med([b for b in own_bases if b is not None]),
            "extra_loop": loop_extra,
            "rate": med([f["rate"] for f in figs]),
            "total": med([f["total"] for f in figs]),
            "cpu": sum(a["cpu"] for a in alone),
            "floor": sum(a["cpu"] for a in alone) / cores,
            "mem_mb": max(a["mem_kb"] for a in alone) / 1024,
        }
    return rows


def report(data: dict[str, Any], args: Any) -> str:
    cores = os.cpu_count() or 1
    rows = summarize(data, cores)
    base = rows["none"]["step_s"]
    lines = [f"model {args.model}: {data['state_bytes'] / 1e9:.2f} GB of state (model + AdamW), FSDP2 on "
             f"{WORLD} CPU processes, {cores} cores (shared with other jobs); {args.steps} steps, a save "
             f"every {args.every}, {args.reps} repetition(s); baseline step {base:.3f} s "
             f"({1 / base:.2f} steps/s); page cache dropped before loads: {data['dropped']}", ""]
    head = (f"{'median per checkpoint':22} {'saves':>5} {'return s':>9} {'extra s':>8} {'extra(own) s':>12} "
            f"{'own base s':>10} {'extra(loop) s':>13} "
            f"{'steps/s in save':>15} {'total s':>8} {'cpu s':>7} {'floor s':>8} {'peak MB/rank':>12}")
    lines.append(head)
    for name, r in rows.items():
        if name == "none":
            continue
        lines.append(f"{name:22} {r['saves']:5d} {r['return']:9.3f} {r['extra']:8.3f} "
                     f"{r['extra_own']:12.3f} {r['own_base']:10.3f} {r['extra_loop']:13.3f} "
                     f"{r['rate']:15.2f} {r['total']:8.3f} {r['cpu']:7.2f} "
                     f"{r['floor']:8.3f} {r['mem_mb']:12.0f}")
    lines += ["", "ratios (same run):"]
    for ours, theirs in PAIRS:
        if ours in rows and theirs in rows:
            a, b = rows[ours], rows[theirs]
            extra = a["extra"] / b["extra"] if b["extra"] > 0 else float("nan")
            own = a["extra_own"] / b["extra_own"] if b["extra_own"] > 0 else float("nan")
            floor = a["extra"] / a["floor"] if a["floor"] > 0 else float("nan")
            lines.append(f"  {ours:21} / {theirs:16}: return {a['return'] / b['return']:.3f}, "
                         f"extra {extra:.3f}, extra (own) {own:.3f}, total {a['total'] / b['total']:.3f}; "
                         f"ours' extra is {floor:.1f}x its CPU floor")
    load = data["load"]
    lines += ["", "cold load (T_load): " + ", ".join(f"{k} {v:.2f} s" for k, v in load.items()),
              "ETTR (paper's appendix; one failure per interval; extra and T_save per checkpoint):"]
    for minutes in (30, 5):
        parts = []
        for name, r in rows.items():
            if name == "none":
                continue
            t_load = load.get(data["systems"][name], 0.0)
            parts.append(f"{name} {ettr(minutes * 60, max(0.0, r['extra']), r['total'], t_load):.5f}")
        lines.append(f"  every {minutes:2d} min: " + ", ".join(parts))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="small")
    parser.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated rows of MODES")
    parser.add_argument("--extra-mode", action="append", default=[], metavar="NAME=SYSTEM:JSON",
                        help='another mode, e.g. ours-x=bcp:{"async_save": true}')
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--settle-steps", type=int, default=1,
                        help="untimed steps at the start of every loop")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8, help="sequence length of a step")
    parser.add_argument("--alone-reps", type=int, default=2, help="saves with training stopped")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "bcp-bench-loop"))
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    parser.add_argument("--report", default=None, metavar="JSON", help="print the report of a saved run")
    args = parser.parse_args()
    if args.report:
        data = json.load(open(args.report))
        for k, v in data["args"].items():
            setattr(args, k, v)
        print(report(data, args))
        return
    modes = {}
    for name in filter(None, args.modes.split(",")):
        if name not in MODES:
            parser.error(f"unknown mode {name!r}; known: {', '.join(MODES)}")
        modes[name] = MODES[name]
    for spec in args.extra_mode:
        name, _, rest = spec.partition("=")
        system, _, kw = rest.partition(":")
        modes[name] = Mode(system, json.loads(kw or "{}"))
    cfg = MODELS[args.model]
    args.dir = os.path.abspath(args.dir)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    n_params = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"{n_params / 1e6:.1f}M parameters; modes {', '.join(modes)}; load average "
          f"{open('/proc/loadavg').read().strip()}", flush=True)
    t = time.perf_counter()
    out_file = f"{args.dir}/result.json"
    mp.start_processes(worker, args=(WORLD, free_port(), cfg, modes, args, out_file), nprocs=WORLD,
                       start_method="spawn")
    data = json.load(open(out_file))
    data["state_bytes"] = n_params * 4 * 3
    data["dropped"] = os.access(DROP_CACHES, os.W_OK)
    data["systems"] = {name: m.system for name, m in modes.items()}
    data["args"] = {k: getattr(args, k) for k in ("model", "steps", "every", "reps")}
    print()
    print(report(data, args))
    print(f"\ntotal {time.perf_counter() - t:.0f}s; load average after: "
          f"{open('/proc/loadavg').read().strip()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
