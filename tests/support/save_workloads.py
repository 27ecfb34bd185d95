"""Rank functions for the save-engine tests: plan cache, async saves (see tests/support/dist.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.engine import staging
from bytecheckpoint.planning import plan_cache
from bytecheckpoint.runtime import comm as bcomm
from bytecheckpoint.storage import register_backend
from bytecheckpoint.storage.local import LocalStorage
from tests.support import workloads as w


class _CountCalls:
    """Counts the save protocol's collectives (Communicator calls) while active."""

    def __init__(self) -> None:
        self.calls = 0
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> _CountCalls:
        for name in ("gather", "scatter", "broadcast", "all_gather"):
            fn = getattr(bcomm.Communicator, name)
            self._saved[name] = fn

            def counted(*a: Any, _fn: Callable = fn, **k: Any) -> Any:
                self.calls += 1
                return _fn(*a, **k)

            setattr(bcomm.Communicator, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._saved.items():
            setattr(bcomm.Communicator, name, fn)


def _state(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model, "optimizer": optim, "extra_state": {"step": step, "rank": dist.get_rank()}}


def _tensors(ref: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in ref.items() if isinstance(v, torch.Tensor)}


def plan_cache_hits_and_invalidations(root: str) -> dict[str, Any]:
    """Save FSDP2 state repeatedly: unchanged (hit), new parameter, new shape, other
    framework, other process group (misses). Returns what each save did."""
    plan_cache.clear()
    model, optim = w.make_fsdp2(seed=0)
    rank = dist.get_rank()
    out: dict[str, Any] = {"cached": [], "calls": [], "plan_s": []}

    def save(name: str, state: dict[str, Any], **kw: Any) -> None:
        with _CountCalls() as counter:
            result = bcp.save(f"{root}/{name}", state, **kw)
        out["cached"].append(result.cached_plan)
        out["calls"].append(counter.calls)
        out["plan_s"].append(result.phases["plan"])

    w.train_step(model, optim, 0, rank)
    save("s1", _state(model, optim, 1), framework="fsdp2", step=1)  # first: plans
    w.train_step(model, optim, 1, rank)
    save("s2", _state(model, optim, 2), framework="fsdp2", step=2)  # unchanged: hit
    out["ref2"] = _tensors(w.full_state(model, optim))
    w.train_step(model, optim, 2, rank)
    save("s3", _state(model, optim, 3), framework="fsdp2", step=3)  # hit again
    out["ref3"] = _tensors(w.full_state(model, optim))
    model.register_parameter("extra_bias", nn.Parameter(torch.arange(6.0)))
    save("s4", {"model": model}, framework="fsdp2", step=4)  # new parameter: miss
    save("s5", {"model": model}, framework="fsdp2", step=5)  # hit
    model.extra_bias = nn.Parameter(torch.arange(8.0))
    save("s6", {"model": model}, framework="fsdp2", step=6)  # new shape: miss
    save("s7", {"model": model}, framework="dtensor", step=7)  # other framework: miss
    pair = [0, 1] if rank < 2 else [2, 3]
    groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    sub = groups[0] if rank < 2 else groups[1]
    lin = nn.Linear(4, 4)
    torch.nn.init.constant_(lin.weight, float(pair[0]))
    save(f"g{pair[0]}/s8", {"model": lin}, framework="ddp", process_group=sub)  # other world: miss
    save(f"g{pair[0]}/s9", {"model": lin}, framework="ddp", process_group=sub)  # hit on that group
    save("s10", {"model": model}, framework="dtensor", step=10)  # the 4-rank plan is still cached
    return out


def load_step(root: str, name: str) -> dict[str, Any]:
    model, optim = w.make_fsdp2(seed=5, lr=1e-3)
    extra: dict[str, Any] = {}
    bcp.load(f"{root}/{name}", {"model": model, "optimizer": optim, "extra_state": extra})
    return {"state": _tensors(w.full_state(model, optim)), "extra": extra}


def structure_changes_on_one_rank(root: str, async_save: bool) -> dict[str, Any]:
    """Rank 1 alone adds a replicated tensor between two saves: its cache misses while the
    others hit. A synchronous save plans again; an async save fails on every rank (one file per
    rank: the hits wrote already) or plans again (files_per="host": nothing is written before
    the world agrees)."""
    plan_cache.clear()
    rank = dist.get_rank()
    shard = torch.arange(8.0).reshape(2, 4) + 10 * rank

    def state(extra: bool) -> dict[str, Any]:
        d: dict[str, Any] = {"w": bcp.TensorShard(shard, (2 * dist.get_world_size(), 4), (2 * rank, 0))}
        if extra:
            d["b"] = torch.full((3,), 7.0)
        return {"model": d}

    bcp.save(f"{root}/first", state(False), framework="manual")
    out: dict[str, Any] = {}
    try:
        result = bcp.save(f"{root}/second", state(rank == 1), framework="manual", async_save=async_save)
        result = result.wait() if async_save else result
        out["second"] = ("saved", result.cached_plan)
    except bcp.CheckpointError as exc:
        out["second"] = ("error", type(exc).__name__, str(exc))
    result = bcp.save(f"{root}/third", state(rank == 1), framework="manual")
    out["third_cached"] = result.cached_plan
    return out


def async_snapshot(root: str, saves: int) -> dict[str, Any]:
    """Async saves whose tensors are changed right after ``save`` returns; the checkpoint
    must hold the values of the moment of the call. Also reports the arena's allocations."""
    model, optim = w.make_fsdp2(seed=0)
    rank = dist.get_rank()
    refs, handles, info = [], [], []
    arena = staging.pool(False)
    allocations = arena.allocations  # the pool is process-wide: earlier tests may have used it
    for step in range(saves):
        w.train_step(model, optim, step, rank)
        ref = _tensors(w.full_state(model, optim))
        handle = bcp.save(f"{root}/step_{step}", _state(model, optim, step), framework="fsdp2",
                          step=step, async_save=True)
        before = [h.done() for h in handles]
        w.clobber(model, optim)
        refs.append(ref)
        handles.append(handle)
        info.append({"blocking_s": handle.blocking_s, "earlier_done": before})
    results = [h.wait() for h in handles]
    return {
        "refs": refs, "info": info, "cached": [r.cached_plan for r in results],
        "done": [h.done() and h.exception() is None for h in handles],
        "arena_allocations": arena.allocations - allocations,
        "arena_bytes": arena.capacity,
        "bytes_written": [r.bytes_written for r in results],
    }


class _FailingStorage(LocalStorage):
    scheme = "failwrite"

    def open_writer(self, path: str):
        if dist.get_rank() == 1 and path.endswith(".safetensors"):
            raise OSError(28, "No space left on device (injected)")
        return super().open_writer(path)


def async_failure(root: str) -> dict[str, Any]:
    """Rank 1 cannot write: every rank's handle reports the failure; nothing is committed;
    the next save works."""
    register_backend("failwrite", _FailingStorage, clobber=True)
    model, optim = w.make_fsdp2(seed=0)
    w.train_step(model, optim, 0, dist.get_rank())
    bcp.save(f"{root}/ok", _state(model, optim, 0), framework="fsdp2")
    handle = bcp.save(f"failwrite://{root}/bad", _state(model, optim, 1), framework="fsdp2",
                      async_save=True)
    exc = handle.exception(timeout=120)
    out = {"error": (type(exc).__name__, str(exc)) if exc else None, "done": handle.done()}
    try:
        handle.wait()
    except Exception as again:  # the failing rank gets its own OSError, the others a summary
        out["wait_raises"] = type(again).__name__
    result = bcp.save(f"{root}/after", _state(model, optim, 2), framework="fsdp2")
    out["after"] = result.total_bytes
    return out


def save_with_arguments_per_rank(root: str) -> dict[str, Any]:
    """Saves where the ranks pass different arguments (a per-rank path, a per-rank step, and
    after a first save, so under a cached plan, a per-rank step), each followed by a save
    with the same arguments on every rank, which must commit and load."""
    rank = dist.get_rank()
    torch.manual_seed(0)  # a replicated model: the same values on every rank
    model = nn.Linear(4, 3)
    state = {"model": model, "extra": {"rank": rank}}
    outcomes: dict[str, Any] = {}

    def attempt(name: str, path: str, step: int) -> None:
        try:
            bcp.save(path, state, step=step, overwrite=True)
            outcomes[name] = "committed"
        except bcp.InvalidArgumentError as exc:
            outcomes[name] = f"refused: {exc}"

    attempt("per-rank path", f"{root}/ckpt_r{rank}", 1)
    attempt("same, fresh plan", f"{root}/ckpt", 1)
    attempt("per-rank step, cached plan", f"{root}/ckpt", 10 + rank)
    attempt("same, cached plan", f"{root}/ckpt", 2)
    into = nn.Linear(4, 3)
    bcp.load(f"{root}/ckpt", {"model": into, "extra": {"rank": -1}})
    outcomes["exact"] = torch.equal(into.weight, model.weight) and torch.equal(into.bias, model.bias)
    return outcomes


def extra_on_rank_0_only(root: str) -> dict[str, Any]:
    """A save where only rank 0 holds ``extra``, then loads on the same ranks, each passing
    ``extra``: strict (a named error on every rank) and not (rank 0 gets its value, rank 1
    keeps its own and is told it is missing)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    state: dict[str, Any] = {"model": nn.Linear(4, 3)}
    if rank == 0:
        state["extra"] = {"a": 1}
    bcp.save(root, state)
    out: dict[str, Any] = {}
    extra = {"a": -1}
    try:
        bcp.load(root, {"model": nn.Linear(4, 3), "extra": extra})
        out["strict"] = "loaded"
    except bcp.CheckpointError as exc:
        out["strict"] = type(exc).__name__
    result = bcp.load(root, {"model": nn.Linear(4, 3), "extra": extra}, strict=False)
    out["value"], out["missing"] = dict(extra), result.missing_keys
    return out
