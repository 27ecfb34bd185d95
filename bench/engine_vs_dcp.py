"""bytecheckpoint vs PyTorch DCP vs torch.save, on one workload, in one run.

    .venv/bin/python bench/engine_vs_dcp.py [--small] [--reps 3] [--dir DIR] [--json OUT]
    .venv/bin/python bench/engine_vs_dcp.py --report RUN1.json RUN2.json ...   # pooled medians

Workload: a GPT-style model (about 300M parameters; ``--small``: about 7M) with AdamW state,
FSDP2 over 4 CPU processes (gloo). Files are fsync'd by all three (DCP's FileSystemWriter
has ``sync_files=True``; torch.save files are fsync'd here). Page caches are dropped before
every cold load when /proc/sys/vm/drop_caches is writable (the output says whether it was).
Systems alternate within each repetition (the order rotates), and medians are printed.

Phases, each in freshly spawned processes:
  limits   one process: sequential write + fsync (1 stream and 4 streams), cold sequential
           read, memory copy into a preallocated tensor
  fsdp4    4 ranks: sync save, async save (blocking and total), cold load, for each system;
           bytecheckpoint's planning time on a first and a repeated save; training step rate
           with an async save in the middle of a loop vs without
  fsdp2    2 ranks: cold load of the 4-rank checkpoints (resharding)
  ddp4     4 ranks, DDP (a smaller model): bytes read from storage by a load on every rank
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
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import drop_caches, make_fsdp, max_over_ranks, sum_over_ranks  # noqa: E402
from demo.model import GPT, GPTConfig, batch, loss_fn  # noqa: E402

FULL = GPTConfig(vocab_size=32003, context=64, dim=1024, heads=16, layers=22, mlp_ratio=3)
SMALL = GPTConfig(vocab_size=8003, context=32, dim=256, heads=4, layers=4, mlp_ratio=3)
DDP_FULL = GPTConfig(vocab_size=16003, context=32, dim=512, heads=8, layers=12, mlp_ratio=3)
RATE_TOKENS = 8  # short sequences in the step-rate loop: a 300M step on 2 shared cores is slow


# -- helpers ---------------------------------------------------------------------------------



def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)



def timed(fn: Any) -> tuple[float, Any]:
    """Wall time of ``fn`` from a common start to the last rank's end."""
    dist.barrier()
    t = time.perf_counter()
    out = fn()
    return max_over_ranks(time.perf_counter() - t), out


def cold(fn: Any, drop: bool) -> tuple[float, Any]:
    dist.barrier()
    if dist.get_rank() == 0 and drop:
        drop_caches()
    return timed(fn)


def rmtree(path: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def finish() -> None:
    """End a worker: results are written; skip process-group teardown, where a DDP reducer
    or a peer that already left can hang in a destructor."""
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=30))


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, cfg: GPTConfig, step: int,
               size: int = 1, tokens: int | None = None) -> None:
    inputs, targets = batch(cfg, step, dist.get_rank(), size=size)
    inputs, targets = inputs[:, :tokens], targets[:, :tokens]
    loss_fn(model, inputs, targets).backward()
    optim.step()
    optim.zero_grad()


# -- the three systems -------------------------------------------------------------------------


class Bcp:
    name = "bytecheckpoint"

    def __init__(self, model: Any, optim: Any) -> None:
        self.state = {"model": model, "optimizer": optim}

    def save(self, path: str) -> Any:
        import bytecheckpoint as bcp

        return bcp.save(path, self.state, framework="fsdp2")

    def async_save(self, path: str) -> Any:
        import bytecheckpoint as bcp

        return bcp.save(path, self.state, framework="fsdp2", async_save=True)

    @staticmethod
    def wait(handle: Any) -> Any:
        return handle.wait()

    def load(self, path: str) -> int:
        import bytecheckpoint as bcp

        return bcp.load(path, self.state, framework="fsdp2").bytes_read


class Dcp:
    name = "dcp"

    def __init__(self, model: Any, optim: Any) -> None:
        self.model, self.optim = model, optim
        # async_save finishes its collectives on a background thread: on the training group
        # they would deadlock with FSDP's own (DCP's docs ask for a separate gloo group).
        self.group = dist.new_group(backend="gloo")

    def _sd(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def save(self, path: str) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.save(self._sd(), storage_writer=dcp.FileSystemWriter(path, sync_files=True))

    def async_save(self, path: str) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.async_save(self._sd(), storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                              process_group=self.group)

    @staticmethod
    def wait(handle: Any) -> Any:
        return (handle.upload_completion if hasattr(handle, "upload_completion") else handle).result()

    def load(self, path: str) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sd = self._sd()
        reader = CountingReader(path)
        dcp.load(sd, storage_reader=reader)
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return reader.bytes_read


def _counting_reader() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class Counting(FileSystemReader):
        """DCP's reader, counting the bytes it reads from storage."""

        bytes_read = 0

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            self.bytes_read += sinfo.length
            return super()._slice_file(file, sinfo)

    return Counting


def CountingReader(path: str) -> Any:  # noqa: N802 - a class made on demand
    return _counting_reader()(path)


class TorchSave:
    """Each rank torch.save's its local shards to its own file (fsync'd); no resharding."""

    name = "torch.save"

    def __init__(self, model: Any, optim: Any) -> None:
        self.model, self.optim = model, optim

    def _local(self) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        def loc(t: Any) -> Any:
            return t.to_local() if isinstance(t, DTensor) else t

        return {"model": {k: loc(v) for k, v in self.model.state_dict().items()},
                "optim": {i: {k: loc(v) for k, v in s.items()} for i, s in
                          enumerate(self.optim.state.values())}}

    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(f"{path}/rank{dist.get_rank()}.pt", "wb") as f:
            torch.save(self._local(), f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, path: str) -> int:
        file = f"{path}/rank{dist.get_rank()}.pt"
        loaded = torch.load(file, weights_only=True)
        mine = self._local()
        for k, v in mine["model"].items():
            v.detach().copy_(loaded["model"][k])
        for i, s in mine["optim"].items():
            for k, v in s.items():
                if isinstance(v, torch.Tensor):
                    v.copy_(loaded["optim"][i][k])
        return os.path.getsize(file)


WRITE_BLOCK = 16 << 20


def sequential_write(path: str, nbytes: int, behind: int = 0, drop: bool = False,
                     direct: bool = False) -> None:
    """Write ``nbytes`` to ``path`` in 16 MiB blocks, then fsync: the machine's limit.
    ``behind`` > 0 starts writeback every this many bytes; ``drop`` also drops what is on
    disk; ``direct`` opens with O_DIRECT (``nbytes`` a multiple of the block)."""
    import mmap

    from bytecheckpoint.storage.writeback import WriteBehind

    src = mmap.mmap(-1, WRITE_BLOCK)  # page-aligned, as O_DIRECT needs
    src.write(b"\1" * WRITE_BLOCK)
    view = memoryview(src)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        wb = WriteBehind(fd, behind, drop=drop)
        done = 0
        while done < nbytes:
            done += os.write(fd, view[: min(WRITE_BLOCK, nbytes - done)])
            wb.advance(done)
        os.fsync(fd)
        wb.finish()
    finally:
        os.close(fd)
        view.release()
        src.close()


class SeqWrite:
    """The machine's limit inside the save rotation: rank 0 writes the state's byte count as
    one sequential file with fsync, under the same conditions (position in the rotation,
    what the disk is still digesting) as the saves it is compared with; other ranks wait."""

    def __init__(self, nbytes: int, drop_behind: bool) -> None:
        self.nbytes = nbytes
        self.drop_behind = drop_behind
        self.name = "seq write, " + ("early writeback + drop-behind" if drop_behind else "plain")

    def save(self, path: str) -> None:
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            sequential_write(f"{path}/seq", self.nbytes, behind=(64 << 20) if self.drop_behind else 0,
                             drop=self.drop_behind)


# -- phases ---------------------------------------------------------------------------------


def phase_limits(root: str, nbytes: int) -> dict[str, Any]:
    os.makedirs(root, exist_ok=True)
    block = WRITE_BLOCK
    write = sequential_write

    def timed_write(path: str, **kw: Any) -> float:
        t = time.perf_counter()
        write(path, nbytes, **kw)
        gbps = nbytes / (time.perf_counter() - t) / 1e9
        os.unlink(path)
        return gbps

    out: dict[str, Any] = {"drop_caches": drop_caches()}
    # An unmeasured first write: the first to allocate page-cache pages pays for it (a VM may
    # hand out its memory lazily), which would skew whichever way is measured first.
    timed_write(f"{root}/seq")
    out["write_fsync_GBps"] = timed_write(f"{root}/seq")
    out["write_fsync_behind_GBps"] = timed_write(f"{root}/seq", behind=64 << 20)
    out["write_fsync_dropbehind_GBps"] = timed_write(f"{root}/seq", behind=64 << 20, drop=True)
    direct = nbytes // block * block  # O_DIRECT writes whole aligned blocks
    t = time.perf_counter()
    try:
        write(f"{root}/direct", direct, direct=True)
        out["write_direct_GBps"] = direct / (time.perf_counter() - t) / 1e9
    except OSError:  # a file system without O_DIRECT
        out["write_direct_GBps"] = 0.0
    if os.path.exists(f"{root}/direct"):
        os.unlink(f"{root}/direct")
    from concurrent.futures import ThreadPoolExecutor

    t = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: write(f"{root}/par{i}", nbytes // 4), range(4)))
    out["write_fsync_4streams_GBps"] = nbytes / (time.perf_counter() - t) / 1e9
    write(f"{root}/seq", nbytes)
    drop_caches()
    t = time.perf_counter()
    fd = os.open(f"{root}/seq", os.O_RDONLY)
    rbuf = bytearray(block)
    total = 0
    while True:
        n = os.readv(fd, [rbuf])
        if not n:
            break
        total += n
    os.close(fd)
    out["read_cold_GBps"] = total / (time.perf_counter() - t) / 1e9
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    out["memcpy_GBps"] = 3 * nbytes / (time.perf_counter() - t) / 1e9
    shutil.rmtree(root, ignore_errors=True)
    return out


WRITE_LIMITS = (  # (key, label): every way the limits phase writes a file sequentially + fsync
    ("write_fsync_GBps", "1 stream, plain"),
    ("write_fsync_behind_GBps", "1 stream, early writeback"),
    ("write_fsync_dropbehind_GBps", "1 stream, early writeback + drop-behind"),
    ("write_direct_GBps", "1 stream, O_DIRECT"),
    ("write_fsync_4streams_GBps", "4 streams, plain"),
)


def phase_fsdp4(rank: int, world: int, port: int, cfg: GPTConfig, root: str, reps: int,
                out_file: str, state_bytes: int) -> None:
    init(rank, world, port)
    drop = rank == 0 and drop_caches()
    drop = bool(max_over_ranks(float(drop)))
    model, optim = make_fsdp(cfg)
    train_step(model, optim, cfg, 0)
    systems = [Bcp(model, optim), Dcp(model, optim), TorchSave(model, optim)]
    res: dict[str, Any] = {"drop_caches": drop, "save": {}, "async_block": {}, "async_total": {},
                           "load": {}, "bytes": {}, "plan_cached_all": []}
    for s in systems:
        for k in ("save", "load"):
            res[k][s.name] = []
        if s.name != "torch.save":
            res["async_block"][s.name] = []
            res["async_total"][s.name] = []

    # bytecheckpoint: a save that plans and a repeated one with the same structure. The
    # very first save also pays one-time costs (first messages on the save group); the
    # planning figure is from a second save whose plan cache was cleared.
    from bytecheckpoint.planning import plan_cache
    Bcp(model, optim).save(f"{root}/plan/warm")
    plan_cache.clear()
    first = Bcp(model, optim).save(f"{root}/plan/first")
    again = Bcp(model, optim).save(f"{root}/plan/again")
    assert not first.cached_plan
    res["plan_first_s"] = max_over_ranks(first.phases["plan"])
    res["plan_cached_s"] = max_over_ranks(again.phases["plan"])
    res["plan_cached"] = again.cached_plan
    res["collect_s"] = [max_over_ranks(first.phases["collect"]), max_over_ranks(again.phases["collect"])]
    rmtree(f"{root}/plan")

    # The first async save of each system allocates its staging memory; time it apart, so
    # the repetitions measure the steady state a training run sees from its second save on.
    res["async_first_block"] = {}
    for s in systems[:2]:
        path = f"{root}/{s.name}/warmup"
        dist.barrier()
        t0 = time.perf_counter()
        handle = s.async_save(path)
        res["async_first_block"][s.name] = max_over_ranks(time.perf_counter() - t0)
        s.wait(handle)
        rmtree(path)

    limits_in_rotation = [SeqWrite(state_bytes, drop_behind=False), SeqWrite(state_bytes, drop_behind=True)]
    for w in limits_in_rotation:
        res["save"][w.name] = []
    for rep in range(reps):
        order = systems[rep % 3:] + systems[: rep % 3]
        writers = [*systems, *limits_in_rotation]
        for s in writers[rep % len(writers):] + writers[: rep % len(writers)]:
            path = f"{root}/{s.name}/sync{rep}"
            t, result = timed(lambda s=s, path=path: s.save(path))
            res["save"][s.name].append(t)
            if s.name == "bytecheckpoint":  # every save after the first reuses the plan
                res["plan_cached_all"].append(max_over_ranks(result.phases["plan"]))
            if isinstance(s, SeqWrite):
                rmtree(f"{root}/{s.name}")
            elif rank == 0:
                res["bytes"][s.name] = dir_bytes(path)
        for s in order:
            t, nread = cold(lambda s=s, rep=rep: s.load(f"{root}/{s.name}/sync{rep}"), drop)
            res["load"][s.name].append(t)
        for s in order:
            if rep + 1 < reps or s.name == "torch.save":
                rmtree(f"{root}/{s.name}/sync{rep}")
        for s in order:
            if s.name == "torch.save":
                continue
            path = f"{root}/{s.name}/async{rep}"
            dist.barrier()
            t0 = time.perf_counter()
            handle = s.async_save(path)
            block = time.perf_counter() - t0
            done = s.wait(handle)
            total = time.perf_counter() - t0
            if s.name == "bytecheckpoint":
                res["plan_cached_all"].append(max_over_ranks(done.phases["plan"]))
                for phase in ("collect", "plan", "stage"):
                    res.setdefault("async_phases", {}).setdefault(phase, []).append(
                        max_over_ranks(done.phases.get(phase, 0.0)))
            res["async_block"][s.name].append(max_over_ranks(block))
            res["async_total"][s.name].append(max_over_ranks(total))
            rmtree(path)
        if rank == 0:
            print(f"  rep {rep + 1}/{reps} done", flush=True)

    # Training step rate: a loop of steps with an async save started in the middle.
    steps = 6
    rates: dict[str, list[float]] = {"none": [], "bytecheckpoint": [], "dcp": []}
    save_done_in_loop: dict[str, list[bool]] = {"bytecheckpoint": [], "dcp": []}
    for rep in range(max(1, reps - 1)):
        for kind in ("none", "bytecheckpoint", "dcp"):
            sysobj = {"bytecheckpoint": systems[0], "dcp": systems[1]}.get(kind)
            dist.barrier()
            t0 = time.perf_counter()
            handle = None
            for i in range(steps):
                if sysobj is not None and i == 2:
                    handle = sysobj.async_save(f"{root}/rate/{kind}{rep}")
                train_step(model, optim, cfg, 100 + i, size=1, tokens=RATE_TOKENS)
            elapsed = max_over_ranks(time.perf_counter() - t0)
            rates[kind].append(steps / elapsed)
            if handle is not None:
                done = handle.done()
                save_done_in_loop[kind].append(bool(max_over_ranks(float(not done)) == 0))
                sysobj.wait(handle)
            rmtree(f"{root}/rate")
    res["step_rate"] = rates
    res["save_done_in_loop"] = save_done_in_loop
    res["steps_per_loop"] = steps
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(res, f)
    dist.barrier()
    finish()


def phase_fsdp2(rank: int, world: int, port: int, cfg: GPTConfig, root: str, reps: int,
                out_file: str) -> None:
    init(rank, world, port)
    drop = rank == 0 and drop_caches()
    drop = bool(max_over_ranks(float(drop)))
    model, optim = make_fsdp(cfg, seed=1)
    train_step(model, optim, cfg, 0)
    systems = [Bcp(model, optim), Dcp(model, optim)]
    res: dict[str, list[float]] = {s.name: [] for s in systems}
    for rep in range(reps):
        for s in systems[rep % 2:] + systems[: rep % 2]:
            t, _ = cold(lambda s=s: s.load(f"{root}/{s.name}/sync{reps - 1}"), drop)
            res[s.name].append(t)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"load": res}, f)
    dist.barrier()
    finish()


def phase_ddp4(rank: int, world: int, port: int, cfg: GPTConfig, root: str, out_file: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bytecheckpoint as bcp

    init(rank, world, port)
    torch.manual_seed(0)
    model = DDP(GPT(cfg))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, optim, cfg, 0)
    state = {"model": model, "optimizer": optim}
    bcp.save(f"{root}/bcp", state, framework="ddp")
    sd = {"model": model.module.state_dict(), "optim": optim.state_dict()}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{root}/dcp"))
    ours = sum_over_ranks(bcp.load(f"{root}/bcp", state, framework="ddp").bytes_read)
    reader = CountingReader(f"{root}/dcp")
    dcp.load(sd, storage_reader=reader)
    theirs = sum_over_ranks(reader.bytes_read)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"bcp_read": ours, "bcp_size": dir_bytes(f"{root}/bcp"),
                       "dcp_read": theirs, "dcp_size": dir_bytes(f"{root}/dcp"),
                       "params": sum(p.numel() for p in model.parameters())}, f)
    rmtree(root)
    finish()


# -- driver -----------------------------------------------------------------------------------


def spawn(fn: Any, world: int, *args: Any) -> None:
    from tests.support.dist import free_port

    mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, start_method="spawn")


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def report(limits: dict[str, Any], a: dict[str, Any], b: dict[str, Any], c: dict[str, Any],
           state_bytes: int) -> str:
    gb = state_bytes / 1e9
    lines = [f"state: {gb:.2f} GB (model + AdamW), FSDP2 on 4 CPU processes",
             f"page cache dropped before cold loads: {'yes' if a['drop_caches'] else 'NO (not permitted)'}",
             "", "machine limits (same run, best of before and after):"]
    writes = [(label, limits[key]) for key, label in WRITE_LIMITS if key in limits]
    lines += [f"  sequential write + fsync, {label:40}: {v:.2f} GB/s" for label, v in writes]
    lines += [f"  {'cold sequential read':66}: {limits['read_cold_GBps']:.2f} GB/s",
              f"  {'memory copy':66}: {limits['memcpy_GBps']:.2f} GB/s", ""]
    rows = [("sync save", "save"), ("async save: blocking", "async_block"),
            ("async save: until committed", "async_total"), ("load (4 ranks, cold)", "load")]
    lines.append(f"{'median seconds':32} {'bytecheckpoint':>15} {'dcp':>10} {'torch.save':>11} "
                 f"{'dcp/ours':>9}")
    for label, key in rows:
        ours = med(a[key]["bytecheckpoint"])
        theirs = med(a[key]["dcp"])
        ts = a[key].get("torch.save")
        tss = f"{med(ts):11.3f}" if ts else f"{'-':>11}"
        lines.append(f"{label:32} {ours:15.3f} {theirs:10.3f} {tss} {theirs / ours:9.2f}x")
    ours, theirs = med(b["load"]["bytecheckpoint"]), med(b["load"]["dcp"])
    lines.append(f"{'load into 2 ranks (cold, reshard)':32} {ours:15.3f} {theirs:10.3f} {'-':>11} "
                 f"{theirs / ours:9.2f}x")
    save = med(a["save"]["bytecheckpoint"])
    bw = a["bytes"]["bytecheckpoint"] / save / 1e9
    in_rotation = [k for k in a["save"] if k.startswith("seq write")]
    if in_rotation:
        lines += ["", "sequential write + fsync of the state's bytes by one process, inside the save "
                  "rotation (same positions and conditions as the saves):"]
        for k in in_rotation:
            ref = med(a["save"][k])
            lines.append(f"  {k:45}: {ref:.3f} s = {state_bytes / ref / 1e9:.2f} GB/s; "
                         f"our sync save reaches {ref / save:.0%} of it (ratio of medians); per "
                         "repetition: " + ", ".join(f"{r / o:.0%}" for r, o in
                                                    zip(a["save"][k], a["save"]["bytecheckpoint"])))
    best_label, best = max(writes, key=lambda w: w[1])
    lines += ["", f"bytecheckpoint sync save: {bw:.2f} GB/s = "
              f"{bw / limits['write_fsync_GBps']:.0%} of the plain 1-stream write+fsync, "
              f"{bw / best:.0%} of the fastest way measured ({best_label}); per way: " + ", ".join(
                  f"{label} {bw / v:.0%}" for label, v in writes if v > 0),
              "first async save (allocates staging memory), blocking: " + ", ".join(
                  f"{k} {v:.3f} s" for k, v in a["async_first_block"].items()),
              "async blocking, ours / dcp: "
              f"{med(a['async_block']['bytecheckpoint']) / med(a['async_block']['dcp']):.3f} (ours: "
              + ", ".join(f"{k} {med(v):.3f} s" for k, v in a["async_phases"].items()) + ")",
              f"planning: first save {a['plan_first_s'] * 1e3:.1f} ms, repeated saves (median of "
              f"{len(a['plan_cached_all'])}) {med(a['plan_cached_all']) * 1e3:.2f} ms "
              f"({med(a['plan_cached_all']) / a['plan_first_s']:.1%}; "
              f"cache hit: {a['plan_cached']}); collecting the state's tensors (every save, "
              f"not planning): {a['collect_s'][0] * 1e3:.1f} / {a['collect_s'][1] * 1e3:.1f} ms"]
    rate = {k: med(v) for k, v in a["step_rate"].items()}
    lines.append(f"training, {a['steps_per_loop']} steps with an async save started halfway: "
                 f"no save {rate['none']:.3f} steps/s; bytecheckpoint {rate['bytecheckpoint']:.3f} "
                 f"({rate['bytecheckpoint'] / rate['none'] - 1:+.0%}); dcp {rate['dcp']:.3f} "
                 f"({rate['dcp'] / rate['none'] - 1:+.0%}); save finished inside the loop: "
                 f"ours {a['save_done_in_loop']['bytecheckpoint']}, dcp {a['save_done_in_loop']['dcp']}")
    lines.append(f"DDP on 4 ranks ({c['params'] / 1e6:.0f}M params): bytes read by a load, all ranks: "
                 f"bytecheckpoint {c['bcp_read'] / 1e6:.1f} MB (checkpoint {c['bcp_size'] / 1e6:.1f} MB, "
                 f"{c['bcp_read'] / c['bcp_size']:.2f}x); dcp {c['dcp_read'] / 1e6:.1f} MB "
                 f"(checkpoint {c['dcp_size'] / 1e6:.1f} MB, {c['dcp_read'] / c['dcp_size']:.2f}x)")
    lines.append("bytes on disk per checkpoint: " + ", ".join(
        f"{k} {v / 1e9:.3f} GB" for k, v in a["bytes"].items()))
    return "\n".join(lines)


def pool_runs(runs: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """Several runs' raw figures as one: every repetition of every run in one list, so the
    medians printed are over all of them; single-valued figures take the median over runs."""
    def cat(get: Any) -> Any:
        first = get(runs[0])
        if isinstance(first, dict):
            return {k: cat(lambda r, k=k: get(r)[k]) for k in first}
        if isinstance(first, list):
            return [x for r in runs for x in get(r)]
        values = [get(r) for r in runs]
        if isinstance(first, bool) or not isinstance(first, int | float) or len(set(values)) == 1:
            return first  # flags, names and counts that every run shares
        return med(values)

    limits = cat(lambda r: {k: v for k, v in r["limits"].items() if k != "measured"})
    a, b, c = (cat(lambda r, n=n: r[n]) for n in ("fsdp4", "fsdp2", "ddp4"))
    return limits, a, b, c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a ~7M-parameter model, to iterate")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "bcp-bench-engine"))
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    parser.add_argument("--report", nargs="+", metavar="JSON", default=None,
                        help="run nothing: print one report over the runs saved with --json")
    args = parser.parse_args()
    if args.report:
        runs = [json.load(open(path)) for path in args.report]
        limits, a, b, c = pool_runs(runs)
        print(f"{len(runs)} runs pooled: every median below is over all their repetitions\n")
        print(report(limits, a, b, c, runs[0]["state_bytes"]))
        return
    cfg = SMALL if args.small else FULL
    ddp_cfg = SMALL if args.small else DDP_FULL
    root = os.path.abspath(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    n_params = sum(p.numel() for p in GPT(cfg).parameters())
    state_bytes = n_params * 4 * 3
    print(f"model: {n_params / 1e6:.1f}M parameters; uptime: {open('/proc/loadavg').read().strip()}",
          flush=True)
    t = time.perf_counter()
    limits = phase_limits(f"{root}/limits", min(2 << 30, max(256 << 20, state_bytes // 2)))
    print(f"limits measured ({time.perf_counter() - t:.0f}s)", flush=True)
    spawn(phase_fsdp4, 4, cfg, f"{root}/ckpt", args.reps, f"{root}/a.json", state_bytes)
    print(f"fsdp4 phase done ({time.perf_counter() - t:.0f}s)", flush=True)
    spawn(phase_fsdp2, 2, cfg, f"{root}/ckpt", args.reps, f"{root}/b.json")
    print(f"fsdp2 phase done ({time.perf_counter() - t:.0f}s)", flush=True)
    spawn(phase_ddp4, 4, ddp_cfg, f"{root}/ddp", f"{root}/c.json")
    after = phase_limits(f"{root}/limits", min(2 << 30, max(256 << 20, state_bytes // 2)))
    # The machine is shared: take the better of the two measurements as its limit.
    limits = {k: max(v, after[k]) if isinstance(v, float) else v for k, v in limits.items()}
    limits["measured"] = "best of one run before and one after the systems"
    a, b, c = (json.load(open(f"{root}/{n}.json")) for n in ("a", "b", "c"))
    print()
    print(report(limits, a, b, c, state_bytes))
    print(f"\ntotal {time.perf_counter() - t:.0f}s; load average after: "
          f"{open('/proc/loadavg').read().strip()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"limits": limits, "fsdp4": a, "fsdp2": b, "ddp4": c, "state_bytes": state_bytes}, f,
                      indent=1)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
