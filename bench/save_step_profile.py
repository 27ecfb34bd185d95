"""Where a save's step goes: a torch.profiler trace of the training steps around one save.

    python bench/save_step_profile.py --model 3.56gb                  # where a CUDA GPU is present
    python bench/save_step_profile.py --model small --device cpu      # the logic, on CPU

The GPT of bench/gpu_loop_cost.py under FSDP2 on a one-rank mesh trains; after warm-up steps
and one untimed save, the profiler records ``--before`` steps, a step that starts with
``bcp.save(async_save=True, snapshot=--snapshot)``, and ``--after`` steps. For each step it
prints, in ms from the step's start: when the host finished it, when the device's compute
stream last ran and how busy it was, the device-to-host copies (the save's snapshot) and the
longest gaps of the compute stream with the kernel that ended each. ``--trace`` also writes
the Chrome trace (gzip).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MODELS, make_fsdp  # noqa: E402
from bench.gpu_loop_cost import init_one_rank, step_once  # noqa: E402

STEP_LABEL = "bench-step-"


def summarize(trace: dict[str, Any], gaps: int = 3) -> list[dict[str, Any]]:
    """Per labelled step of a Chrome trace: host span, compute-stream activity, D2H copies."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = sorted((e for e in events if str(e.get("name", "")).startswith(STEP_LABEL)
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in str(e.get("name", ""))]
    # the compute stream: the one that ran the most kernel time
    busy_by: dict[Any, float] = {}
    for k in kernels:
        busy_by[k.get("tid")] = busy_by.get(k.get("tid"), 0.0) + k["dur"]
    compute = max(busy_by, key=busy_by.__getitem__) if busy_by else None
    rows = []
    for i, s in enumerate(steps):
        t0 = s["ts"]
        t1 = steps[i + 1]["ts"] if i + 1 < len(steps) else float("inf")  # the next step's start
        ks = [k for k in kernels if k.get("tid") == compute and t0 <= k["ts"] < t1]
        cs = [c for c in copies if t0 <= c["ts"] < t1]
        idle = []
        for a, b in zip(ks, ks[1:]):
            idle.append((b["ts"] - (a["ts"] + a["dur"]), a["ts"] + a["dur"] - t0, a["name"]))
        idle.sort(reverse=True)
        rows.append({
            "step": s["name"][len(STEP_LABEL):],
            "host_ms": s["dur"] / 1e3,
            "first_kernel_ms": (ks[0]["ts"] - t0) / 1e3 if ks else None,
            "last_kernel_end_ms": (max(k["ts"] + k["dur"] for k in ks) - t0) / 1e3 if ks else None,
            "compute_busy_ms": sum(k["dur"] for k in ks) / 1e3,
            "d2h": [((c["ts"] - t0) / 1e3, c["dur"] / 1e3, c.get("tid")) for c in cs],
            "gaps": [(g / 1e3, at / 1e3, name[:60]) for g, at, name in idle[:gaps]],
        })
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        line = f"step {r['step']:>10}: host {r['host_ms']:7.1f} ms"
        if r["first_kernel_ms"] is not None:
            line += (f"; compute stream {r['first_kernel_ms']:6.1f} .. {r['last_kernel_end_ms']:6.1f} ms,"
                     f" busy {r['compute_busy_ms']:6.1f} ms")
        print(line)
        if r["d2h"]:
            start = min(d[0] for d in r["d2h"])
            end = max(d[0] + d[1] for d in r["d2h"])
            print(f"    D2H: {len(r['d2h'])} copies, {start:.1f} .. {end:.1f} ms, busy "
                  f"{sum(d[1] for d in r['d2h']):.1f} ms, streams {sorted({str(d[2]) for d in r['d2h']})}")
        for gap, at, name in r["gaps"]:
            if gap >= 1.0:
                print(f"    gap {gap:6.1f} ms at {at:6.1f} ms after {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="3.56gb")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--snapshot", choices=("overlapped", "blocking"), default="overlapped")
    parser.add_argument("--staging-max-bytes", type=int, default=None,
                        help="bound the arena (the copy runs in rounds through a ring)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--before", type=int, default=2)
    parser.add_argument("--after", type=int, default=4)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "bcp-bench-save-step"))
    parser.add_argument("--trace", default=None, help="write the Chrome trace here (.json.gz)")
    args = parser.parse_args()
    import bytecheckpoint as bcp

    device = torch.device(args.device)
    init_one_rank(device)
    try:
        cfg = MODELS[args.model]
        model, optim = make_fsdp(cfg, device=device)
        state = {"model": model, "optimizer": optim}
        shutil.rmtree(args.dir, ignore_errors=True)
        for s in range(3):
            step_once(model, optim, cfg, s, args.batch, device)
        bcp.save(os.path.join(args.dir, "warm"), state, framework="fsdp2",
                 async_save=True, snapshot=args.snapshot,
                 staging_max_bytes=args.staging_max_bytes).wait()  # the arena is made here
        for s in range(3):
            step_once(model, optim, cfg, 100 + s, args.batch, device)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        handle = None
        with torch.profiler.profile(activities=activities) as prof:
            for s in range(args.before + 1 + args.after):
                saving = s == args.before
                with torch.profiler.record_function(f"{STEP_LABEL}{'save' if saving else s}"):
                    if saving:
                        t = time.perf_counter()
                        handle = bcp.save(os.path.join(args.dir, "timed"), state, framework="fsdp2",
                                          async_save=True, snapshot=args.snapshot,
                                          staging_max_bytes=args.staging_max_bytes)
                        print(f"save() returned in {(time.perf_counter() - t) * 1e3:.1f} ms")
                    step_once(model, optim, cfg, 200 + s, args.batch, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
        assert handle is not None
        result = handle.wait()
        print(f"save committed in {result.duration_s:.2f} s; phases (s): "
              + ", ".join(f"{k} {v:.3f}" for k, v in sorted(result.phases.items())))
        path = os.path.join(args.dir, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        if args.trace:
            with gzip.open(args.trace, "wt") as f:
                json.dump(trace, f)
        print(f"{torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, torch "
              f"{torch.__version__}: {args.model}, snapshot={args.snapshot}, "
              f"staging_max_bytes={args.staging_max_bytes}")
        print_rows(summarize(trace))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
