"""Rank-side helpers for the storage tests (run through tests/support/dist.py pools)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist

import bytecheckpoint as bcp
import telemetry
from bytecheckpoint.storage import faults
from tests.support import workloads as w
from tests.support.helpers import env_set


def set_faults(spec: str | None, env: dict[str, str] | None = None) -> None:
    """Install a fault spec in this rank (None removes it) and set storage env settings."""
    for key, value in (env or {}).items():
        os.environ[key] = value
    faults.install(spec)


def injected() -> int:
    inj = faults.active()
    return inj.injected if inj is not None else 0


def save_reporting_error(root: str, steps: int) -> dict[str, Any]:
    """Like ``fsdp2_train_save`` but returns the error this rank saw instead of raising."""
    try:
        return {"ok": w.fsdp2_train_save(root, steps)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def flush_telemetry() -> int:
    telemetry.flush()
    return dist.get_rank()


def save_taking_turns(root: str, slots_dir: str, host_writers: int = 1, optim: bool = False,
                      heavy: int = 1, again: bool = False) -> dict[str, Any]:
    """A synchronous save of 12 MiB per rank (past the slot threshold) with ``host_writers``
    host write slots (``BCP_STORAGE_HOST_WRITERS``), and with ``optim`` a second file of 24
    MiB per rank, rank 0 writing ``heavy`` times as much as each other rank, then a load into
    fresh tensors: this rank's slot intervals (wall clock, comparable across the host's
    processes) and whether the load returned every byte. With ``again``, a second save of the
    same state follows (the plan cache serves it): its intervals, and whether it was served."""
    import time

    import torch

    import bytecheckpoint as bcp
    from bytecheckpoint.storage import write_slots

    rank = dist.get_rank()
    held: list[tuple[float, float]] = []
    real_take = write_slots.take

    def recording_take(*args: Any, **kwargs: Any) -> write_slots.Slot:
        slot = real_take(*args, **kwargs)
        if slot.fd is None:
            return slot
        start, release = time.time(), slot.release

        def recorded() -> None:
            held.append((start, time.time()))
            release()
        slot.release = recorded  # type: ignore[method-assign]
        return slot

    env = {"BCP_STORAGE_HOST_WRITERS": str(host_writers), write_slots.SLOTS_DIR_ENV: slots_dir}
    write_slots.take = recording_take
    try:
        with env_set(env):
            gen = torch.Generator().manual_seed(rank)
            units = [heavy] + [1] * (dist.get_world_size() - 1)  # rank 0 holds ``heavy`` units
            state = {"w": torch.randn(units[rank] * (3 << 20), generator=gen)}
            if optim:
                state["m"] = torch.randn(units[rank] * (6 << 20), generator=gen)
            else:
                state["b"] = torch.randn(7, generator=gen)

            def kinds(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
                if not optim:
                    return {"model": {k: tensors[k] for k in ("w", "b")}}  # one file (an object)

                def shard(x: torch.Tensor) -> bcp.TensorShard:  # this rank's part of a 4-rank tensor
                    unit = x.numel() // units[rank]
                    return bcp.TensorShard(x, (unit * sum(units),), (unit * sum(units[:rank]),))
                # two files per rank: the model's kind and the optimizer's
                return {"model": {"w": shard(tensors["w"])}, "optim": {"m": shard(tensors["m"])}}
            bcp.save(f"{root}/turns", kinds(state))
            first = list(held)
            cached = again and bcp.save(f"{root}/turns-again", kinds(state)).cached_plan
            back = {k: torch.zeros_like(v) for k, v in state.items()}
            bcp.load(f"{root}/turns", kinds(back))
    finally:
        write_slots.take = real_take
    exact = all(torch.equal(state[k], back[k]) for k in state)
    return {"held": first, "held_again": held[len(first):], "cached": cached, "exact": exact}


def save_and_load_with_launcher_env(root: str, env: dict[str, str | None]) -> dict[str, Any]:
    """A manager's steps, a save and a load with ``RANK`` / ``WORLD_SIZE`` as ``env`` gives
    them (None: unset, as under ``mp.spawn``), the telemetry context rebuilt from that
    environment before each; the pool's environment and context are restored after. This
    rank's pid, its rank and when it began, to match events."""
    from telemetry.context import reset_context

    try:
        with env_set(env):
            reset_context()
            started = time.time()
            # the manager first: nothing before it has stamped the context
            manager = bcp.CheckpointManager(f"{root}-managed", record_step_time=True)
            for step in range(1, 4):  # a train.step span per step after the first
                manager.should_save(step)
            manager.close()
            reset_context()  # and the save and the load stamp it themselves
            w.fsdp2_train_save(root, 1)
            w.fsdp2_load(f"{root}/step_1")
            telemetry.flush()
    finally:
        reset_context()
    return {"pid": os.getpid(), "rank": dist.get_rank(), "started": started}


def save_and_load_on_mesh(root: str, shape: tuple[int, ...], names: tuple[str, ...], sub: str | None,
                          preset: dict[str, int | None], before: tuple[str, ...] | None = None
                          ) -> dict[str, Any]:
    """A save and a load of one DTensor on a device mesh of ``shape`` and dimension ``names``
    (on the sub-mesh of dimension ``sub`` when given, as a pipeline stage's tensors are), the
    program having set the telemetry fields ``preset`` first, and with ``before`` a save on a
    mesh of those names before that; the load starts from a fresh context, as a restarted
    job's first load does. This rank's pid and its coordinate in the whole mesh, to
    match the events; the context is reset after."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from bytecheckpoint.runtime import identity
    from telemetry.context import reset_context

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    on = mesh[sub] if sub else mesh
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)

    def module(values: torch.Tensor, where: Any) -> torch.nn.Module:  # sharded tensors live in modules
        m = torch.nn.Module()
        m.w = torch.nn.Parameter(distribute_tensor(values, where, [Shard(0)] * where.ndim))
        return m
    try:
        reset_context()
        identity._stamped.clear()
        telemetry.set_context(**preset)
        if before:
            earlier = init_device_mesh("cpu", shape, mesh_dim_names=before)
            bcp.save(f"{root}-before", {"model": module(full, earlier)})
        bcp.save(root, {"model": module(full, on)})
        # the load as a restarted job's first call: nothing stamped yet
        reset_context()
        identity._stamped.clear()
        telemetry.set_context(**preset)
        back = module(torch.zeros_like(full), on)
        bcp.load(root, {"model": back})
        telemetry.flush()
        exact = torch.equal(back.w.full_tensor(), full)
    finally:
        reset_context()
        identity._stamped.clear()
    return {"pid": os.getpid(), "coordinate": list(mesh.get_coordinate()), "exact": exact}
