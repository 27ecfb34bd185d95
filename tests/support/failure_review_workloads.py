"""Rank functions for tests/distributed/test_failure_review.py: one rank fails (an interrupt,
an I/O error, its process dies) in a load or a save; the others must hear of it by name, and
the next operation on the group must give exact values (no message of the failed one left)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.engine import load as load_engine
from bytecheckpoint.engine import load_pipeline
from bytecheckpoint.engine import save as save_engine
from bytecheckpoint.storage import faults


def module(seed: int | None) -> nn.Module:
    """A replicated module (every rank loads all of it, so boxes are exchanged between
    ranks); zeros when ``seed`` is None."""
    m = nn.Module()
    g = torch.Generator().manual_seed(seed or 0)
    for name, shape in (("a", (4096,)), ("b", (64, 64))):
        m.register_buffer(name, torch.zeros(shape) if seed is None else torch.randn(shape, generator=g))
    return m


def exact(got: nn.Module, seed: int) -> bool:
    ref = module(seed)
    return all(torch.equal(getattr(got, k), getattr(ref, k)) for k in ("a", "b"))


def _raise(exc: BaseException) -> Callable[..., Any]:
    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise exc
    return fail


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except BaseException as exc:  # the interrupt included: it is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _on_rank_1(obj: Any, name: str, new: Any, fn: Callable[[], Any]) -> str:
    """``fn``'s outcome with ``obj.name`` replaced by ``new`` on rank 1."""
    old = getattr(obj, name)
    if dist.get_rank() == 1:
        setattr(obj, name, new)
    try:
        return _outcome(fn)
    finally:
        setattr(obj, name, old)


def _load_exact(path: str, seed: int) -> bool:
    got = module(None)
    bcp.load(path, {"model": got})
    return exact(got, seed)


def load_failures(root: str) -> dict[str, Any]:
    """Loads of one checkpoint that fail on rank 1 (interrupted while planning, interrupted
    while copying, an EIO read), each followed by a load of another checkpoint; then a save
    and a load of it on the same group."""
    bcp.save(f"{root}/one", {"model": module(1)})
    bcp.save(f"{root}/two", {"model": module(2)})
    load_one = lambda: bcp.load(f"{root}/one", {"model": module(None)})  # noqa: E731
    out: dict[str, Any] = {}
    out["plan"] = _on_rank_1(load_engine, "_plan_local", _raise(KeyboardInterrupt("stop in plan")), load_one)
    out["plan then"] = _load_exact(f"{root}/two", 2)
    out["copy"] = _on_rank_1(load_pipeline, "copy_out", _raise(KeyboardInterrupt("stop in copy")), load_one)
    out["copy then"] = _load_exact(f"{root}/two", 2)
    if dist.get_rank() == 1:  # its second read (the first is the file check's)
        faults.install("permanent=1;errno=EIO;ops=read_into;fail_call=2")
    try:
        out["eio"] = _outcome(load_one)
    finally:
        faults.install(None)
    out["eio then"] = _load_exact(f"{root}/two", 2)
    bcp.save(f"{root}/three", {"model": module(3)})
    out["save then"] = _load_exact(f"{root}/three", 3)
    return out


def save_interrupted(root: str) -> dict[str, Any]:
    """step_1 saved; step_2 interrupted in rank 1's write; what the root holds then, what
    loads from it, and a save and load after it on the same group."""
    bcp.save(f"{root}/step_1", {"model": module(1)}, step=1)
    out: dict[str, Any] = {}
    out["save"] = _on_rank_1(save_engine, "write_rank", _raise(KeyboardInterrupt("stop in write")),
                             lambda: bcp.save(f"{root}/step_2", {"model": module(2)}, step=2))
    dist.barrier()
    out["listing"] = sorted(n for n in os.listdir(root) if not n.startswith("."))
    out["latest exact"] = _load_exact(root, 1)
    bcp.save(f"{root}/step_3", {"model": module(3)}, step=3)
    out["then exact"] = _load_exact(root, 3)
    return out


# -- a rank that dies: a world of its own (the pool's would be broken) ------------------------


def _dying_rank(rank: int, port: int, root: str, moment: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    bcp.save(f"{root}/step_1", {"model": module(1)}, step=1)
    if rank == 1:
        die = lambda *_a, **_k: os._exit(3)  # noqa: E731
        if moment == "load":
            load_engine._plan_local = die
        else:  # after the plan round, in its write
            save_engine.write_rank = die
    t = time.monotonic()
    outcome = _outcome(lambda: bcp.load(f"{root}/step_1", {"model": module(None)}) if moment == "load"
                       else bcp.save(f"{root}/step_2", {"model": module(2)}, step=2))
    with open(os.path.join(root, f"rank{rank}.outcome"), "w") as f:
        json.dump([outcome, time.monotonic() - t], f)
    os._exit(0)  # no destroy_process_group: its peer is gone


def dying_world(root: str, moment: str, port: int, timeout: float = 120.0) -> dict[int, Any]:
    """Rank 1 of a fresh 2-rank world dies in a load (``moment="load"``) or in a save's write
    (``"save"``); what each rank that lived reported: rank -> ``[outcome, seconds]``."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_dying_rank, args=(r, port, root, moment)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    out = {}
    for r in range(2):
        try:
            with open(os.path.join(root, f"rank{r}.outcome")) as f:
                out[r] = json.load(f)
        except FileNotFoundError:
            pass
    return out


def save_sources_fail(root: str) -> dict[str, Any]:
    """step_2's save fails on rank 1 while it finds its boxes' bytes (after the plan round, in
    the sync and the async save); what each rank raises, and a save and load after it."""
    bcp.save(f"{root}/step_1", {"model": module(1)}, step=1)
    out: dict[str, Any] = {}
    boom = _raise(RuntimeError("no bytes for a box"))
    out["sync"] = _on_rank_1(save_engine, "_source_views", boom,
                             lambda: bcp.save(f"{root}/step_2", {"model": module(2)}, step=2))
    out["async"] = _on_rank_1(save_engine, "_source_views", boom,
                              lambda: bcp.save(f"{root}/step_2", {"model": module(2)}, step=2,
                                               async_save=True).wait())
    dist.barrier()
    out["listing"] = sorted(n for n in os.listdir(root) if not n.startswith("."))
    bcp.save(f"{root}/step_3", {"model": module(3)}, step=3)
    out["then exact"] = _load_exact(root, 3)
    return out
