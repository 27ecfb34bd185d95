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

from bench.common import MODELS, free_port  # noqa: E402
from demo.model import GPT, GPTConfig, batch, loss_fn  # noqa: E402

MODES = ("ours-overlapped", "ours-blocking", "dcp-async", "dcp-async-cached", "dcp-async-staged")
PAIRS = (("ours-overlapped", "dcp-async"), ("ours-overlapped", "dcp-async-cached"),
         ("ours-overlapped", "dcp-async-staged"), ("ours-blocking", "dcp-async"),
         ("ours-blocking", "dcp-async-cached"))


def make_model(cfg: GPTConfig, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    mesh = init_device_mesh(device.type, (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


class Saver:
    """One mode's save call; ``save`` returns (done(), wait(), before_step())."""

    def __init__(self, mode: str, model: Any, optim: Any) -> None:
        self.mode, self.model, self.optim = mode, model, optim
        self.stager: Any = None
        self.stage_s: list[float] = []  # ours: the D2H copy of each save (its "stage" phase)
        if mode == "dcp-async-staged":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                       use_async_staging=True, use_non_blocking_copy=cuda))
        if mode.startswith("dcp"):
            self.group = dist.new_group(backend="gloo")  # DCP's background collectives

    def save(self, path: str, step: int) -> tuple[Any, Any, Any, list[float]]:
        """(done, wait, before_step, [commit time]) of a save started now."""
        end: list[float] = []
        if self.mode.startswith("ours"):
            import bytecheckpoint as bcp

            snapshot = "overlapped" if self.mode == "ours-overlapped" else "blocking"
            t_call = time.perf_counter()
            h = bcp.save(path, {"model": self.model, "optimizer": self.optim}, framework="fsdp2",
                         step=step, async_save=True, snapshot=snapshot, overwrite=True)

            def wait() -> None:
                if not end:
                    r = h.wait()
                    end.append(t_call + r.duration_s)  # the save's own clock: call to commit
                    self.stage_s.append(r.phases.get("stage", 0.0))
            return h.done, wait, None, end
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim)
        writer = dcp.FileSystemWriter(path, sync_files=True,
                                      cache_staged_state_dict=self.mode == "dcp-async-cached")
        out = dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer,
                             process_group=self.group, async_stager=self.stager)
        fut, before = out, None
        if hasattr(out, "upload_completion"):
            fut, before = out.upload_completion, out.staging_completion.result
        fut.add_done_callback(lambda _f: end.append(time.perf_counter()))

        def wait_dcp() -> None:
            fut.result()
            while not end:
                time.sleep(0.001)
        return fut.done, wait_dcp, before, end

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


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
    saver = Saver(mode, model, optim) if mode else None
    path = os.path.join(root, mode or "none")
    steps = every * (args.saves + 1) if saver else args.baseline_steps
    returns, totals, times, spans, windows = [], [], [], [], []
    pending: tuple[Any, ...] | None = None
    before = None
    if saver is not None:  # untimed: staging memory is allocated, the plan is made
        _, wait, b, _ = saver.save(path + "-warm", 0)
        if b is not None:
            b()
        wait()
        shutil.rmtree(path + "-warm", ignore_errors=True)
    for s in range(args.settle_steps):
        step_once(model, optim, cfg, 10_000 + s, args.batch, device)
    for s in range(steps):
        t0 = time.perf_counter()
        if saver is not None and s % every == 0 and s // every < args.saves:
            if pending is not None:
                pending[1]()  # one save in flight at a time: the loop waits for the last
                totals.append(pending[3][0] - pending[4])
                windows.append((pending[4], pending[3][0]))
                pending = None
            t = time.perf_counter()
            done, wait, before, end = saver.save(os.path.join(path, str(s)), s)
            returns.append(time.perf_counter() - t)
            pending = (done, wait, before, end, t)
        step_once(model, optim, cfg, s, args.batch, device, before)
        before = None
        t1 = time.perf_counter()
        times.append(t1 - t0)
        spans.append((t0, t1))
        if pending is not None and not pending[3] and pending[0]():
            pending[1]()  # finished: its commit time is known now
    t0 = time.perf_counter()
    if pending is not None:
        pending[1]()
        totals.append(pending[3][0] - pending[4])
        windows.append((pending[4], pending[3][0]))
    tail = time.perf_counter() - t0
    if saver is not None:
        saver.close()
    shutil.rmtree(path, ignore_errors=True)
    return {"steps": times, "spans": spans, "windows": windows, "tail": tail, "returns": returns,
            "totals": totals, "stage_s": saver.stage_s if saver is not None else []}


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
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=600))
    cfg = MODELS[args.model]
    model, optim = make_model(cfg, device)
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
            print(f"  {a} / {b}: return {rows[a]['return'] / rows[b]['return']:.3f}, extra "
                  f"{rows[a]['extra'] / max(rows[b]['extra'], 1e-9):.3f}, extra (own) "
                  f"{rows[a]['extra_own'] / max(rows[b]['extra_own'], 1e-9):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "raw": raw, "device": name}, f)
    shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
