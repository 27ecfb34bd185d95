"""The training-loop cost of a checkpoint on one GPU: bytecheckpoint against PyTorch DCP, in one run.

    python bench/gpu_loop_cost.py --model 3.56gb            # where a CUDA GPU is present
    python bench/gpu_loop_cost.py --model small --device cpu --every-s 1   # the logic, on CPU

The GPT workloads of bench/train_loop_cost.py (``--model``: 1.3gb, 3.56gb of fp32 parameters
and AdamW state), under FSDP2 on a one-rank mesh on the GPU, train with a save every
``--every-s`` seconds of training (rounded to whole steps from the loop with no saves), once
per mode and once with no saves. Each step ends with ``loss.item()``, as a loop that logs its
loss does. Modes:

  ours-overlapped   bcp.save(async_save=True, snapshot="overlapped"): returns once planned; the
                    D2H copy runs on a side stream into the pinned arena while the next
                    forward and backward run; the optimizer step's kernels are queued behind it
  ours-blocking     bcp.save(async_save=True): returns once the D2H copy is done
  dcp-async         dcp.async_save with FileSystemWriter as its stager (a copy into pinned
                    memory allocated for each save, then returns)
  dcp-async-cached  the same with FileSystemWriter(cache_staged_state_dict=True): the pinned
                    copy is allocated once and reused
  dcp-async-staged  dcp.async_save with DefaultStager(pinned memory, async staging,
                    non-blocking copies), reused: returns at once; by DCP's contract the loop
                    waits for ``staging_completion`` before the next optimizer step

Per checkpoint (medians over ``--saves`` timed saves, after one untimed save per mode):
  return   time until save() returns
  extra    the loop's wall time over (steps x the median step of the loop with no saves),
           per save: everything training lost to checkpointing, waits for a previous save
           included
  total    save call to commit
"""

from __future__ import annotations

import argparse
import json
import math
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MODELS, free_port, make_fsdp  # noqa: E402
from bench.train_loop_cost import MODES as SYSTEMS  # noqa: E402
from bench.train_loop_cost import BcpPending, make_system  # noqa: E402
from demo.model import GPTConfig, batch, loss_fn  # noqa: E402

MODES = ("ours-overlapped", "ours-blocking", "dcp-async", "dcp-async-cached", "dcp-async-staged")
PAIRS = (("ours-overlapped", "dcp-async"), ("ours-overlapped", "dcp-async-cached"),
         ("ours-overlapped", "dcp-async-staged"), ("ours-blocking", "dcp-async"),
         ("ours-blocking", "dcp-async-cached"))


def init_one_rank(device: torch.device) -> None:
    """A world of one process on ``device`` (NCCL for CUDA, with gloo for host tensors)."""
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=600))


def step_once(model: Any, optim: Any, cfg: GPTConfig, step: int, size: int, device: torch.device,
              before_step: Any = None) -> None:
    inputs, targets = batch(cfg, step, 0, size=size)
    loss = loss_fn(model, inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True))
    loss.backward()
    if before_step is not None:
        before_step()
    optim.step()
    optim.zero_grad(set_to_none=True)
    loss.item()  # the loop logs its loss: the host waits for the step


def run_loop(mode: str | None, model: Any, optim: Any, cfg: GPTConfig, args: Any, every: int,
             device: torch.device, root: str) -> dict[str, Any]:
    """One loop with a save every ``every`` steps (``mode``: a row of train_loop_cost's MODES;
    None: no saves): per step its time and span, per save its return, window and D2H time."""
    system = make_system(SYSTEMS[mode], model, optim) if mode else None
    path = os.path.join(root, mode or "none")
    steps = every * (args.saves + 1) if system else args.baseline_steps
    returns, totals, times, spans, windows, stage_s = [], [], [], [], [], []
    pending: Any = None

    def finish(p: Any) -> None:  # one save in flight at a time: the loop waits for the last
        p.wait()
        totals.append(p.finished_at - p.t_call)
        windows.append((p.t_call, p.finished_at))
        if isinstance(p, BcpPending):
            stage_s.append(p.result.phases.get("stage", 0.0))

    if system is not None:  # untimed: staging memory is allocated, the plan is made
        warm = system.save(path + "-warm", 0)
        if warm.before_step is not None:
            warm.before_step()
        warm.wait()
        shutil.rmtree(path + "-warm", ignore_errors=True)
    for s in range(args.settle_steps):
        step_once(model, optim, cfg, 10_000 + s, args.batch, device)
    for s in range(steps):
        t0 = time.perf_counter()
        before = None
        if system is not None and s % every == 0 and s // every < args.saves:
            if pending is not None:
                finish(pending)
            pending = system.save(os.path.join(path, str(s)), s)
            returns.append(time.perf_counter() - pending.t_call)
            before = pending.before_step
        step_once(model, optim, cfg, s, args.batch, device, before)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        spans.append((t0, t1))
    t0 = time.perf_counter()
    if pending is not None:
        finish(pending)
    tail = time.perf_counter() - t0
    if system is not None:
        system.close()
    shutil.rmtree(path, ignore_errors=True)
    return {"steps": times, "spans": spans, "windows": windows, "tail": tail, "returns": returns,
            "totals": totals, "stage_s": stage_s}


def own_extra(r: dict[str, Any]) -> float | None:
    """Extra loop time per save against the median step of the same loop outside every save's
    window (call to commit, and the step that ends after it): loops of different modes run
    minutes apart, and a drift of the step time between them moves the other figure."""
    def inside(span: tuple[float, float]) -> bool:
        return any(span[1] > a and span[0] < b for a, b in r["windows"])

    flags = [inside(sp) for sp in r["spans"]]
    for i, f in enumerate(list(flags)):  # the first step ending after a window closes
        if f and i + 1 < len(flags):
            flags[i + 1] = True
    outside = [t for t, f in zip(r["steps"], flags) if not f]
    if len(outside) < 5 or not r["returns"]:
        return None
    base = statistics.median(outside)
    return (sum(t - base for t, f in zip(r["steps"], flags) if f) + r["tail"]) / len(r["returns"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="3.56gb")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--saves", type=int, default=5, help="timed saves per mode")
    parser.add_argument("--every-s", type=float, default=5.0, help="seconds of training between saves")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--baseline-steps", type=int, default=30)
    parser.add_argument("--settle-steps", type=int, default=3)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "bcp-bench-gpu-loop"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    init_one_rank(device)
    cfg = MODELS[args.model]
    model, optim = make_fsdp(cfg, device=device)
    for s in range(args.settle_steps):  # optimizer state exists, kernels are compiled
        step_once(model, optim, cfg, 20_000 + s, args.batch, device)
    state_gb = sum(t.numel() * t.element_size() for t in model.parameters()) * 3 / 1e9
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    base = run_loop(None, model, optim, cfg, args, 0, device, args.dir)
    step_s = statistics.median(base["steps"])
    every = max(2, math.ceil(args.every_s / step_s))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}: {args.model} ({state_gb:.2f} GB of state), "
          f"step {step_s * 1e3:.1f} ms, a save every {every} steps", flush=True)
    rows: dict[str, dict[str, float]] = {}
    raw: dict[str, Any] = {"base": base, "every": every, "step_s": step_s}
    for mode in args.modes.split(","):
        try:
            r = run_loop(mode, model, optim, cfg, args, every, device, args.dir)
        except Exception as exc:  # one system's failure must not hide the others' figures
            print(f"  {mode:18s} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            shutil.rmtree(os.path.join(args.dir, mode), ignore_errors=True)
            continue
        raw[mode] = r
        lost = sum(r["steps"]) + r["tail"] - len(r["steps"]) * step_s
        own = own_extra(r)
        rows[mode] = {"return": statistics.median(r["returns"]), "extra": lost / len(r["returns"]),
                      "extra_own": own if own is not None else float("nan"),
                      "total": statistics.median(r["totals"])}
        copy = (f"   D2H {statistics.median(r['stage_s']) * 1e3:.0f} ms "
                f"({state_gb / statistics.median(r['stage_s']):.1f} GB/s)"
                if r["stage_s"] and statistics.median(r["stage_s"]) > 0 else "")
        print(f"  {mode:18s} return {rows[mode]['return'] * 1e3:8.1f} ms   extra "
              f"{rows[mode]['extra'] * 1e3:8.1f} ms   extra (own) {rows[mode]['extra_own'] * 1e3:8.1f} ms"
              f"   total {rows[mode]['total']:.2f} s{copy}", flush=True)
    print("\nratios (ours / DCP)")
    for a, b in PAIRS:
        if a in rows and b in rows:
            print(f"  {a} / {b}: " + ", ".join(f"{label} {ratio(rows[a][k], rows[b][k])}" for label, k in
                                               (("return", "return"), ("extra", "extra"),
                                                ("extra (own)", "extra_own"))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "raw": raw, "device": name}, f)
    shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


def ratio(ours: float, theirs: float) -> str:
    """ours / theirs, or why there is none: a loop that lost no time to DCP's saves (noise can
    make that figure zero or negative) has no ratio to state."""
    if not theirs > 0:
        return f"n/a (DCP's is {theirs * 1e3:.1f} ms)"
    return f"{ours / theirs:.3f}"


if __name__ == "__main__":
    main()
