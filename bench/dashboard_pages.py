"""Dashboard page times on synthetic telemetry: 1,024 ranks x 50 checkpoints in an embedded store.

Two measurements per page, each the median of --repeats runs with the query cache cleared:
- ``query+figure``: the page's queries plus building its figures and serialising them to JSON
  (what ``st.plotly_chart`` sends), called directly;
- ``page (AppTest)``: the whole page script run by Streamlit's AppTest harness, widgets and
  protobuf serialisation included. The browser's own drawing is not measured.

    .venv/bin/python bench/dashboard_pages.py [--ranks 1024] [--checkpoints 50] [--repeats 5]
        [--store DIR [--reuse]]
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dashboard import figures, frames, goodput, queries, store  # noqa: E402
from telemetry.store import connect, ensure_schema, insert_alerts, insert_events  # noqa: E402

JOB, RUN = "bench", "r1"
SAVE_PHASES = (("save.plan", 0.05), ("save.stage", 0.3), ("save.serialize", 0.2), ("save.write", 1.5),
               ("save.commit", 0.1))
LOAD_PHASES = (("load.metadata", 0.05), ("load.plan", 0.1), ("load.read", 1.2), ("load.apply", 0.2),
               ("load.barrier", 0.05))


def topology(ranks: int) -> tuple[int, int, int]:
    tp = 8 if ranks % 8 == 0 else 1
    pp = 4 if ranks % (tp * 4) == 0 else 1
    return tp, ranks // (tp * pp), pp


def synthetic_events(ranks: int, checkpoints: int, loads_every: int, seed: int = 0) -> list[dict]:
    """Per checkpoint and rank: the whole call, its phases (two writes / reads) and their storage ops."""
    rng = random.Random(seed)
    tp, dp, _ = topology(ranks)
    events: list[dict] = []
    t = 1_700_000_000.0
    for c in range(checkpoints):
        step = (c + 1) * 100
        ops = [("save", SAVE_PHASES, f"/ckpt/step_{step}")]
        if c % loads_every == loads_every - 1:
            ops.append(("load", LOAD_PHASES, f"/ckpt/step_{step}"))  # a load of that step
        slow = rng.randrange(ranks)
        for op, phases, path in ops:
            for rank in range(ranks):
                ctx = {"job": JOB, "run": RUN, "step": step, "rank": rank, "world_size": ranks,
                       "tp": rank % tp, "dp": (rank // tp) % dp, "pp": rank // (tp * dp),
                       "host": f"node{rank // 8}", "pid": 1000 + rank, "checkpoint": path,
                       "checkpoint_op": op}
                start = t
                for name, base in phases:
                    repeat = 2 if name in ("save.write", "load.read") else 1
                    for _ in range(repeat):
                        slowdown = 4.0 if rank == slow and repeat == 2 else 1.0
                        dur = base / repeat * rng.uniform(0.8, 1.2) * slowdown
                        nbytes = 256 << 20 if repeat == 2 else None
                        events.append({**ctx, "event_id": uuid.uuid4().hex, "name": name, "ts": start,
                                       "duration_s": dur, "outcome": "ok", "bytes": nbytes})
                        if repeat == 2:
                            io = "write" if op == "save" else "read"
                            events.append({**ctx, "event_id": uuid.uuid4().hex, "name": f"storage.{io}",
                                           "ts": start, "duration_s": dur * 0.9, "outcome": "ok",
                                           "bytes": nbytes, "op": io, "backend": "file", "attempt": 1})
                        start += dur
                events.append({**ctx, "event_id": uuid.uuid4().hex, "name": op, "ts": t,
                               "duration_s": start - t, "outcome": "ok", "path": path})
            t += 600.0
    return events


def slow_rank_alerts(events: list[dict]) -> list[dict]:
    out = []
    for e in events:
        if e["name"] == "save.write" and e["duration_s"] > 1.5:
            out.append({"alert_id": uuid.uuid4().hex, "rule": "slow_rank", "severity": "warning", "job": JOB,
                        "run": RUN, "checkpoint": e["checkpoint"], "checkpoint_op": "save", "step": e["step"],
                        "phase": "save.write", "rank": e["rank"], "value": 10.0, "threshold": 3.5,
                        "message": f"rank {e['rank']} is slow in save.write", "details": "{}",
                        "created_at": datetime.datetime.fromtimestamp(e["ts"], tz=datetime.timezone.utc)})
    return list({(a["checkpoint"], a["rank"]): a for a in out}.values())


def page_work(dsn: str) -> dict[str, Callable[[], object]]:
    """Each page's queries and figures, as the page scripts call them (without Streamlit)."""

    def q(fn, **kw):
        return store.run_query(dsn, fn, **kw)

    def newest_save():
        ckpts = q(queries.checkpoints, job=JOB, run=RUN)
        row = ckpts[ckpts["op"] == "save"].iloc[0]
        return {"job": row["job"], "run": row["run"], "checkpoint": row["checkpoint"], "op": row["op"]}

    def overview():
        ckpts = frames.with_tiers(q(queries.checkpoints, job=JOB, run=RUN), q(queries.tiering_moves))
        return ckpts, q(queries.jobs), q(queries.alerts, job=JOB, run=RUN)

    def topology_page():
        params = newest_save()
        phases = q(queries.rank_phases, **params)
        alerts = q(queries.checkpoint_alerts, **params)
        cells, _ = frames.layout_coords(frames.heatmap_cells(phases, "save", "save.write", "duration"))
        return figures.topology_heatmap(cells, title="t", colorbar="s",
                                        flagged=alerts["rank"].dropna().astype(int).tolist()).to_json()

    def timeline_page(all_ranks: bool):
        def run():
            phases = q(queries.rank_phases, **newest_save())
            ranks = None if all_ranks else frames.slowest_ranks(phases, 32)
            fig = figures.timeline(frames.timeline_bars(phases, ranks), title="t").to_json()
            rank = frames.slowest_ranks(phases, 1)[0]
            breakdown = frames.rank_breakdown(phases, rank)
            return fig, figures.rank_breakdown(breakdown, rank=rank, title="t").to_json()
        return run

    def trends():
        ckpts = q(queries.checkpoints, job=JOB, run=RUN)
        lo, hi = q(queries.io_time_range, job=JOB, run=RUN)
        bucket = frames.io_bucket_s(hi - lo)
        return [figures.step_durations(ckpts, title="t").to_json(),
                figures.phase_trends(q(queries.step_phases, job=JOB, run=RUN), title="t").to_json(),
                figures.io_latency(q(queries.io_latency, job=JOB, run=RUN), title="t").to_json(),
                figures.io_throughput(q(queries.io_throughput, job=JOB, run=RUN, bucket_s=bucket), title="t",
                                      bucket_s=bucket).to_json()]

    def goodput_page():
        ckpts = q(queries.checkpoints, job=JOB, run=RUN)
        saves = ckpts[ckpts["op"] == "save"]
        t_iter = q(queries.iteration_time, job=JOB, run=RUN) or goodput.estimated_iteration_s(saves) or 1.0
        g = goodput.GoodputInputs(iteration_s=t_iter, interval=goodput.measured_interval(saves["step"]) or 1,
                                  save_s=float(saves["e2e_s"].median()), load_s=1.0)
        return figures.ettr_curve(goodput.what_if(g, range(1, 4 * g.interval + 1)), current_n=g.interval,
                                  title="t").to_json()

    return {
        "overview": overview, "topology": topology_page, "timeline (32 stragglers)": timeline_page(False),
        "timeline (all ranks)": timeline_page(True), "trends": trends,
        "alerts": lambda: q(queries.alerts, job=JOB, run=RUN), "goodput": goodput_page,
        "tiering": lambda: frames.tiering_state(q(queries.tiering_moves)),
    }


def median_s(fn: Callable[[], object], repeats: int, before: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def apptest_page(page: str, query: dict[str, str]) -> Callable[[], object]:
    from streamlit.testing.v1 import AppTest

    def run():
        at = AppTest.from_file(str(ROOT / "dashboard" / "app_pages" / f"{page}.py"), default_timeout=120)
        for key, value in query.items():
            at.query_params[key] = value
        at.run()
        if at.exception:
            raise RuntimeError(f"{page}: {at.exception[0].value}")
        return at
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--checkpoints", type=int, default=50)
    parser.add_argument("--loads-every", type=int, default=5, help="a load after every k-th save")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=5000, help="events per insert (the ingester's default)")
    parser.add_argument("--store", default=None, help="store directory (default: a temporary one)")
    parser.add_argument("--reuse", action="store_true", help="measure a --store that already holds data")
    args = parser.parse_args()

    path = Path(args.store or tempfile.mkdtemp(prefix="bcp-dash-bench-")).absolute()
    dsn = f"chdb://{path}"
    client = connect(dsn)
    ensure_schema(client)
    tp, dp, pp = topology(args.ranks)
    stored = int(client.command("SELECT count() FROM events"))
    if args.reuse and stored:
        print(f"store {path}: reusing its {stored:,} events")
    else:
        t0 = time.perf_counter()
        events = synthetic_events(args.ranks, args.checkpoints, args.loads_every)
        # Batches of the ingester's size, and no OPTIMIZE: queries read unmerged parts with FINAL,
        # as they do on a store the ingester keeps appending to.
        for i in range(0, len(events), args.batch):
            insert_events(client, events[i:i + args.batch])
        insert_alerts(client, slow_rank_alerts(events))
        print(f"store {path}: {len(events):,} events ({args.ranks} ranks = TP {tp} x DP {dp} x PP {pp}, "
              f"{args.checkpoints} checkpoints) written in {time.perf_counter() - t0:.1f} s")
    client.close()

    import logging

    from dashboard import ui

    logging.getLogger("streamlit").setLevel(logging.ERROR)  # AppTest's bare-mode warnings

    os.environ[store.DSN_ENV] = dsn
    clear = ui._cached.clear
    rows = []
    for name, fn in page_work(dsn).items():
        fn()  # warm: connection, schema check
        rows.append((name, "query+figure", median_s(fn, args.repeats)))
    newest = store.run_query(dsn, queries.checkpoints, job=JOB, run=RUN)
    row = newest[newest["op"] == "save"].iloc[0]
    query = {"job": JOB, "run": RUN, "checkpoint": row["checkpoint"], "op": "save"}
    for page in ("overview", "topology", "timeline", "trends", "alerts", "goodput", "tiering"):
        fn = apptest_page(page, query)
        fn()
        rows.append((page, "page (AppTest)", median_s(fn, args.repeats, before=clear)))
    store.close()
    print(f"\nmedian of {args.repeats}, query cache cleared before each run")
    print(f"{'page':28} {'measure':16} {'seconds':>8}")
    for name, what, seconds in rows:
        print(f"{name:28} {what:16} {seconds:8.3f}")


if __name__ == "__main__":
    main()
