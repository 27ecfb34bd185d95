"""The main job: ``python -m demo`` (or ./scripts/demo.sh).

1. 4 processes (gloo, CPU) train a GPT with FSDP2 and checkpoint every few steps.
2. 2 processes resume from the latest checkpoint: the 4-way shards are resharded 2-way at
   load time; a fingerprint of the full state proves nothing changed; training goes on.
3. A tiering pass cools every checkpoint but the newest into ``<root>/cold`` (standing for an
   HDD tier); each cooled one still verifies through its original path.
4. A summary: steps, checkpoints, sizes, save and load times, telemetry events.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import socket
import statistics
import time

import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

import bytecheckpoint as bcp
from bytecheckpoint.data import TokenSource, synthetic_sources
from demo.model import GPT
from demo.train import DEMO_CONFIG, JobSpec, run_rank
from storage_tiering import load_config, run_once


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, spec: JobSpec) -> list[dict]:
    mp.spawn(run_rank, args=(world, _port(), json.dumps(spec.__dict__)), nprocs=world, join=True)
    kind = "resume" if spec.resume else "train"
    out = []
    for r in range(world):
        with open(f"{spec.root}/stats/{kind}-rank{r}.json") as f:
            out.append(json.load(f))
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--root", default="runs/demo", help="where checkpoints and telemetry go")
    parser.add_argument("--train-world", type=int, default=4)
    parser.add_argument("--resume-world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--resume-steps", type=int, default=4)
    args = parser.parse_args()

    root = os.path.abspath(args.root)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(f"{root}/stats")
    os.environ["BCP_TELEMETRY_DIR"] = f"{root}/telemetry"
    console = Console(width=150)
    n_params = sum(p.numel() for p in GPT(DEMO_CONFIG).parameters())
    console.print(f"[bold]bytecheckpoint demo[/] — GPT {n_params / 1e6:.1f}M params, FSDP2, gloo on CPU")

    console.print(f"training on {args.train_world} processes for {args.steps} steps, "
                  f"checkpoint every {args.save_every} ...")
    sources = synthetic_sources(f"{root}/data", [1500, 1000], vocab=DEMO_CONFIG.vocab_size,
                                min_len=8, max_len=300, seed=0)
    train = _launch(args.train_world, JobSpec(root, 0, args.steps, args.save_every, False, sources))
    console.print(f"resuming on {args.resume_world} processes from the latest checkpoint ...")
    resume = _launch(args.resume_world, JobSpec(root, 0, args.resume_steps, args.save_every, True,
                                                sources))

    table = Table(title=f"checkpoints (saved by {args.train_world} ranks)")
    for col in ("step", "path", "size", "metadata", "files", "save s (max rank)", "plan / write / commit s"):
        table.add_column(col)
    for i, save in enumerate(train[0]["saves"]):
        per_rank = [t["saves"][i] for t in train]
        phases = per_rank[0]["phases"]
        table.add_row(str(save["step"]), os.path.relpath(save["path"]), _mib(save["total_bytes"]),
                      f"{save['metadata_bytes']:,} B", str(save["files"]),
                      f"{max(p['seconds'] for p in per_rank):.3f}",
                      f"{phases['plan']:.3f} / {phases['write']:.3f} / {phases['commit']:.3f}")
    console.print(table)

    load = [r["load"] for r in resume]
    same = {r["fingerprint_after_load"] for r in resume} == {train[0]["fingerprint_at_last_save"]}
    console.print(
        f"load on {args.resume_world} ranks from step {load[0]['step']}: "
        f"{max(x['seconds'] for x in load):.3f} s (max rank), "
        f"read {_mib(sum(x['bytes_read'] for x in load))} in all; "
        f"full-state fingerprint {'[green]matches[/]' if same else '[red]DIFFERS[/]'} the saved one "
        f"({train[0]['fingerprint_at_last_save']})"
    )
    last = max(int(k) for k in train[0]["losses"])
    final = max(int(k) for k in resume[0]["losses"])
    resumed_loss = statistics.fmean(r["losses"][str(final)] for r in resume)
    first_loss = statistics.fmean(t["losses"]["1"] for t in train)
    last_loss = statistics.fmean(t["losses"][str(last)] for t in train)
    console.print(f"loss (mean over ranks): step 1 {first_loss:.4f} → step {last} {last_loss:.4f} "
                  f"(trained on {args.train_world}) → step {final} {resumed_loss:.4f} "
                  f"(resumed on {args.resume_world})")
    data_ok = _report_data(console, sources, train, resume, args)
    tiering_ok = _tiering_pass(console, root)
    spool = f"{root}/telemetry"
    events = 0
    for name in os.listdir(spool) if os.path.isdir(spool) else []:
        with open(os.path.join(spool, name)) as f:
            events += sum(1 for _ in f)
    console.print(f"telemetry: {events} events spooled in {os.path.relpath(spool)}")
    if not same:
        raise SystemExit("resumed state differs from the saved state")
    if not data_ok:
        raise SystemExit("the data loader lost or repeated tokens across the resume")
    if not tiering_ok:
        raise SystemExit("a cooled checkpoint failed verification or a move failed")


def _tiering_pass(console: Console, root: str) -> bool:
    """Cool every checkpoint but the newest to the cold tier, then verify each cooled one
    through its original path (the links)."""
    config = load_config(env={}, hot=f"{root}/checkpoints", cold=f"{root}/cold", cool_after=0,
                         keep_newest=1)
    os.makedirs(config.cold, exist_ok=True)
    t0 = time.perf_counter()
    report = run_once(config)
    seconds = time.perf_counter() - t0
    problems = [p for r in report.cooled for p in bcp.verify(r.checkpoint)]
    moved = sum(r.bytes for r in report.cooled)
    names = ", ".join(os.path.basename(r.checkpoint) for r in report.cooled) or "none"
    console.print(
        f"tiering: cooled {names} ({_mib(moved)}) to {os.path.relpath(config.cold)} in {seconds:.2f} s; "
        f"hot tier {_mib(report.hot_bytes_before)} → {_mib(report.hot_bytes_after)}; cooled checkpoints "
        + ("[green]verify[/] through their original paths" if not problems else f"[red]{problems[0]}[/]")
        + (f"; [red]{len(report.failed)} failed[/]" if report.failed else "")
    )
    return not problems and not report.failed


def _report_data(console: Console, sources: list[str], train: list[dict], resume: list[dict],
                 args: argparse.Namespace) -> bool:
    """Tokens trained on up to the checkpoint, plus everything after the resume (training,
    then the rest of the data) must cover every token of every sample exactly once."""
    saved_step = max(s["step"] for s in train[0]["saves"])
    runs = [r for t in train for step, rs in t["data"].items() if int(step) <= saved_step for r in rs]
    runs += [r for t in resume for rs in t["data"].values() for r in rs]
    runs += [r for t in resume for r in t["drained"]]
    counts: collections.Counter = collections.Counter()
    for sid, start, n in runs:
        for pos in range(start, start + n):
            counts[(sid, pos)] += 1
    expected = {((s << 40) | i, pos) for s, path in enumerate(sources)
                for i, length in enumerate(TokenSource(path).length(j) for j in range(len(TokenSource(path))))
                for pos in range(length)}
    repeated = sum(1 for c in counts.values() if c > 1)
    lost = len(expected - set(counts))
    collect = [s["loader_collect_s"] for t in train for s in t["saves"] if s["loader_prefetched"]]
    console.print(
        f"data: {len(expected):,} tokens in {len({k[0] for k in expected}):,} samples; trained on "
        f"{args.train_world} DP ranks to step {saved_step}, resumed on {args.resume_world} DP "
        f"ranks and read to the end: {lost} lost, {repeated} repeated"
        + (f"; loader state at checkpoints collected in {1e3 * max(collect):.2f} ms (prefetched)"
           if collect else "")
    )
    return lost == 0 and repeated == 0


if __name__ == "__main__":
    main()
