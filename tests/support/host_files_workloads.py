"""Rank functions for the host-files tests (``save(..., files_per="host")``; see tests/support/dist.py).

4 ranks are 2 "hosts" of 2 (``host_size=2``): ranks 0 and 2 are the leaders that write.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from bytecheckpoint.engine import host_files
from bytecheckpoint.engine import writer as writer_module
from bytecheckpoint.planning import plan_cache
from bytecheckpoint.storage import faults
from tests.support import workloads as w
from tests.support.helpers import env_set

HOST = {"files_per": "host", "host_size": 2}


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model, "optimizer": optim, "extra_state": {"step": step, "rank": dist.get_rank()}}


def _tensors(ref: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in ref.items() if isinstance(v, torch.Tensor)}


def sync_cached_and_async(root: str) -> dict[str, Any]:
    """FSDP2 + AdamW + a per-rank object, saved with host files three times: planned, from
    the plan cache, and async (the tensors change as soon as the handle is returned)."""
    plan_cache.clear()
    model, optim = w.make_fsdp2(seed=0)
    rank = dist.get_rank()
    out: dict[str, Any] = {"cached": [], "bytes_written": [], "files": []}

    def record(result: Any) -> None:
        out["cached"].append(result.cached_plan)
        out["bytes_written"].append(result.bytes_written)
        out["files"].append(result.files)

    w.train_step(model, optim, 0, rank)
    record(bcp.save(f"{root}/h1", _state(model, optim, 1), framework="fsdp2", step=1, **HOST))
    out["ref1"] = _tensors(w.full_state(model, optim))
    w.train_step(model, optim, 1, rank)
    record(bcp.save(f"{root}/h2", _state(model, optim, 2), framework="fsdp2", step=2, **HOST))
    out["ref2"] = _tensors(w.full_state(model, optim))
    w.train_step(model, optim, 2, rank)
    out["ref3"] = _tensors(w.full_state(model, optim))
    handle = bcp.save(f"{root}/h3", _state(model, optim, 3), framework="fsdp2", step=3,
                      async_save=True, **HOST)
    w.clobber(model, optim)
    record(handle.wait())
    out["after_async"] = _tensors(w.full_state(model, optim))
    return out


def save_once(root: str, block: int | None = None, chunk_bytes: int = 4 << 20) -> dict[str, torch.Tensor]:
    """One synchronous host-files save of FSDP2 + AdamW state to ``root``/h (any backend).
    ``block``: members send in blocks of this many bytes (many blocks per piece)."""
    plan_cache.clear()
    model, optim = w.make_fsdp2(seed=0)
    w.train_step(model, optim, 0, dist.get_rank())
    default = host_files.TRANSFER_BYTES
    host_files.TRANSFER_BYTES = block or default
    try:
        bcp.save(f"{root}/h", _state(model, optim, 1), framework="fsdp2", step=1,
                 chunk_bytes=chunk_bytes, **HOST)
    finally:
        host_files.TRANSFER_BYTES = default
    return _tensors(w.full_state(model, optim))


def _failing_source(fail_at: int) -> Any:
    """``tensor_bytes`` (where a synchronous save reads a CPU tensor) failing at call
    ``fail_at``: a read error in the middle of a member's stream."""
    real = writer_module.tensor_bytes
    calls = [0]

    def source(t: torch.Tensor) -> memoryview:
        calls[0] += 1
        if calls[0] == fail_at:
            raise OSError(5, "Input/output error (injected into a member's source)")
        return real(t)

    return source


def _attempt(root: str, name: str, model: Any, optim: Any) -> dict[str, Any]:
    t = time.perf_counter()
    try:
        bcp.save(f"{root}/{name}", _state(model, optim, 9), framework="fsdp2", **HOST)
        outcome: tuple = ("saved",)
    except Exception as exc:  # every rank must get here, quickly
        outcome = (type(exc).__name__, str(exc))
    return {"outcome": outcome, "seconds": time.perf_counter() - t}


def failures(root: str) -> dict[str, Any]:
    """A committed host-files checkpoint, then three failed saves: a member's source raises
    in the middle of its stream (rank 1, host 0; the save runs from the plan cache), a
    member's first piece fails (rank 3, host 1; a planned save), and a leader's storage write
    fails while its member streams to it (rank 2, host 1). Every rank must raise each time,
    quickly, and the next save must work."""
    plan_cache.clear()
    model, optim = w.make_fsdp2(seed=0)
    rank = dist.get_rank()
    w.train_step(model, optim, 0, rank)
    bcp.save(f"{root}/good", _state(model, optim, 1), framework="fsdp2", step=1, **HOST)
    out: dict[str, Any] = {"ref": _tensors(w.full_state(model, optim))}
    w.train_step(model, optim, 1, rank)
    real = writer_module.tensor_bytes
    try:
        if rank == 1:
            writer_module.tensor_bytes = _failing_source(3)  # after two pieces went out
        out["member_mid_stream"] = _attempt(root, "bad1", model, optim)
        writer_module.tensor_bytes = real
        if rank == 3:
            writer_module.tensor_bytes = _failing_source(1)  # its very first piece
        out["member_first_piece"] = _attempt(root, "bad2", model, optim)
        writer_module.tensor_bytes = real
        # Host 1's leader cannot write its model file (a permanent storage error).
        faults.install("fail_every=1;ops=write;path=model-h00001;permanent=1;ranks=2")
        out["leader_write"] = _attempt(root, "bad3", model, optim)
    finally:
        writer_module.tensor_bytes = real
        faults.install(None)
    result = bcp.save(f"{root}/after", _state(model, optim, 2), framework="fsdp2", step=2, **HOST)
    out["after_files"] = result.files
    out["after_ref"] = _tensors(w.full_state(model, optim))
    return out


def with_env(env: dict[str, str], module: str, name: str, *args: Any) -> Any:
    """Call ``module.name(*args)`` with ``env`` set in this rank's environment."""
    import importlib

    with env_set(env):
        return getattr(importlib.import_module(module), name)(*args)


def _try_save(root: str, name: str, model: Any, optim: Any, **kwargs: Any) -> dict[str, Any]:
    t = time.perf_counter()
    try:
        result = bcp.save(f"{root}/{name}", _state(model, optim, 5), framework="fsdp2", **kwargs)
        outcome: tuple = ("saved", result.cached_plan)
    except Exception as exc:  # every rank must get here, within seconds
        outcome = (type(exc).__name__, str(exc))
    return {"outcome": outcome, "seconds": time.perf_counter() - t}


def files_per_differs(root: str) -> dict[str, Any]:
    """Ranks that disagree on ``files_per``: host mode on some ranks, one file per rank on the
    others, by argument and by environment, on a planned save and on saves whose plan cache
    hit on the host-mode ranks or on the rank-mode ones. Then the same save, agreed."""
    plan_cache.clear()
    model, optim = w.make_fsdp2(seed=0)
    rank = dist.get_rank()
    w.train_step(model, optim, 0, rank)
    out: dict[str, Any] = {}
    even = HOST if rank % 2 == 0 else {}
    out["planned"] = _try_save(root, "planned", model, optim, **even)
    bcp.save(f"{root}/hosts", _state(model, optim, 5), framework="fsdp2", **HOST)  # caches host mode
    out["hosts_hit"] = _try_save(root, "hosts_hit", model, optim, **(HOST if rank != 1 else {}))
    bcp.save(f"{root}/ranks", _state(model, optim, 5), framework="fsdp2")  # caches rank mode
    out["ranks_hit"] = _try_save(root, "ranks_hit", model, optim, **(HOST if rank == 0 else {}))
    with env_set({"BCP_FILES_PER": "host", "BCP_COMM_HOST_SIZE": "2"} if rank == 3 else {}):
        out["environment"] = _try_save(root, "environment", model, optim)
    out["agreed"] = _try_save(root, "agreed", model, optim, **HOST)
    out["agreed_again"] = _try_save(root, "agreed_again", model, optim, **HOST)
    out["ref"] = _tensors(w.full_state(model, optim))
    return out
