"""Rank functions for the tree-coordination tests (16 processes; see tests/support/dist.py)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from bytecheckpoint.errors import RankFailedError
from bytecheckpoint.format.metadata import METADATA_FILE, CheckpointMetadata
from bytecheckpoint.planning import plan_cache
from bytecheckpoint.runtime.comm import Communicator, Outcome
from tests.support.helpers import env_set

# 16 ranks as 4 "hosts" of 4, host leaders in pairs: a three-level tree.
TREE = {"BCP_COMM_TREE": "1", "BCP_COMM_HOST_SIZE": "4", "BCP_COMM_FANOUT": "2"}



class _CountSends:
    """Counts the tree's point-to-point messages this rank sends and receives."""

    def __enter__(self) -> _CountSends:
        self.sent = self.received = 0
        self._send, self._recv = Communicator._send, Communicator._recv_raw

        def send(comm: Communicator, *a: Any, **k: Any) -> None:
            self.sent += 1
            self._send(comm, *a, **k)

        def recv(comm: Communicator, *a: Any, **k: Any) -> bytes:
            self.received += 1
            return self._recv(comm, *a, **k)

        Communicator._send, Communicator._recv_raw = send, recv  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        Communicator._send, Communicator._recv_raw = self._send, self._recv  # type: ignore[method-assign]


def _collectives(comm: Communicator) -> dict[str, Any]:
    """Every collective of the save protocol, with values of different sizes per rank."""
    rank, world = comm.rank, comm.world_size
    out: dict[str, Any] = {}
    gathered = comm.gather(Outcome(value=(rank, "x" * rank)))
    out["gather"] = None if gathered is None else [o.value for o in gathered]
    per_rank = [Outcome(value={"to": r, "pad": list(range(r))}) for r in range(world)] if rank == 0 else None
    out["scatter"] = comm.scatter(per_rank).value
    out["broadcast"] = comm.broadcast(Outcome(value=("plan", list(range(50)))) if rank == 0 else None).value
    out["all_gather"] = [o.value for o in comm.all_gather(Outcome(value=rank * rank))]

    def no_gather(outcome: Outcome) -> list[Outcome]:
        raise AssertionError("gathered every outcome although no rank failed")

    comm.all_gather = no_gather  # type: ignore[method-assign]
    try:
        comm.check_all(None, "reading")  # no rank failed: one all-reduce, nothing gathered
        out["check_all_ok"] = "passed"
    finally:
        del comm.all_gather
    try:
        comm.check_all(ValueError("disk full") if rank == 7 else None, "writing")
        out["check_all"] = "passed"
    except RankFailedError as exc:
        out["check_all"] = (type(exc).__name__, str(exc), exc.failures)
    except ValueError as exc:
        out["check_all"] = ("local", str(exc))
    return out


def _state(rank: int, world: int, scale: float) -> dict[str, Any]:
    """Rows of ``w`` per rank, a replicated ``b``, and a distributed optimizer's flat slices."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(world * 3, 5, generator=g) * scale
    b = torch.randn(6, generator=g) * scale
    opt = torch.randn(9, 7, generator=g) * scale
    cuts = [63 * i // world for i in range(world + 1)]
    a, z = cuts[rank], cuts[rank + 1]
    return {
        "model": {"w": bcp.TensorShard(w[3 * rank : 3 * rank + 3].clone(), (world * 3, 5), (3 * rank, 0)),
                  "b": b.clone()},
        "optim": {"opt": bcp.TensorShard(opt.reshape(-1)[a:z].clone(), (9, 7), (0, 0), (9, 7), (a, z))},
        "extra_state": {"rank": rank},
    }


def _values(state: dict[str, Any]) -> list[torch.Tensor]:
    return [state["model"]["w"].data, state["model"]["b"], state["optim"]["opt"].data]


def _metadata(path: str) -> dict[str, Any]:
    with open(os.path.join(path, METADATA_FILE), "rb") as f:
        meta = CheckpointMetadata.from_bytes(f.read())
    b = meta.boxes
    return {
        "tensors": meta.tensors, "files": meta.files, "objects": meta.objects,
        "boxes": [np.asarray(getattr(b, c)).tolist() for c in
                  ("tensor", "offsets", "lengths", "file", "byte_offset", "byte_length", "checksums")],
    }


def tree_matches_flat(root: str) -> dict[str, Any]:
    """The collectives and whole saves, flat and through the tree; returns both sides."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"rank": rank}
    with _CountSends() as flat_count:
        out["flat"] = _collectives(Communicator(None, dedicated=True, tree=False))
    with _CountSends() as tree_count:
        comm = Communicator(None, dedicated=True, tree=True, host_size=4, fanout=2)
        out["tree"] = _collectives(comm)
    out["node"] = comm.node
    out["flat_sends"], out["tree_sends"] = flat_count.sent, tree_count.sent
    out["tree_received"] = tree_count.received

    # Whole saves: flat, then through the tree (sync, a cache hit, async), then loads.
    plan_cache.clear()
    with env_set({"BCP_COMM_TREE": "0"}):
        flat = bcp.save(f"{root}/flat", _state(rank, world, 1.0), framework="manual", step=1)
    plan_cache.clear()
    with env_set(TREE), _CountSends() as save_count:
        first = bcp.save(f"{root}/tree", _state(rank, world, 1.0), framework="manual", step=1)
        again = bcp.save(f"{root}/tree_again", _state(rank, world, 2.0), framework="manual", step=2)
        handle = bcp.save(f"{root}/tree_async", _state(rank, world, 3.0), framework="manual", step=3,
                          async_save=True)
        later = handle.wait()
        loaded = {}
        for name, scale in (("tree", 1.0), ("tree_again", 2.0), ("tree_async", 3.0)):
            target = _state(rank, world, 0.0)
            bcp.load(f"{root}/{name}", target)
            want = _state(rank, world, scale)
            loaded[name] = all(torch.equal(x, y) for x, y in zip(_values(target), _values(want)))
    out["save_sends"] = save_count.sent
    out["cached"] = [flat.cached_plan, first.cached_plan, again.cached_plan, later.cached_plan]
    out["loaded"] = loaded
    if rank == 0:
        out["metadata"] = {name: _metadata(f"{root}/{name}") for name in ("flat", "tree")}
    return out
