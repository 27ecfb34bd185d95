"""The pieces memo (``engine.pieces_memo``): a save whose state holds the same tensors as the
last one reuses the pieces it listed, and any change that could make them wrong (a new tensor
object, a DTensor's local tensor swapped, a shape or dtype changed behind the same object)
lists them again. Every checkpoint is loaded back and compared bit for bit with the state at
``save()`` time. The functions without ``test_`` run on every rank of a gloo group."""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from bytecheckpoint.engine import pieces_memo
from bytecheckpoint.planning import plan_cache
from tests.support import workloads as w
from tests.support.helpers import assert_same_state, same_bits


def _counting(served: list[bool]) -> Any:
    """Make ``pieces_memo.lookup`` record, per save, whether it served it; returns the original."""
    lookup = pieces_memo.lookup

    def counted(*args: Any, **kwargs: Any) -> Any:
        found = lookup(*args, **kwargs)
        served.append(found is not None)
        return found

    pieces_memo.lookup = counted
    return lookup


def fsdp2_memo_changes(root: str) -> dict[str, Any]:
    plan_cache.clear()
    pieces_memo.clear()
    served: list[bool] = []
    original = _counting(served)
    rank = dist.get_rank()
    model, optim = w.make_fsdp2(seed=0)
    state = {"model": model, "optimizer": optim}
    refs, cached, collector_on = [], [], []
    try:
        for k in range(5):
            w.train_step(model, optim, k, rank)
            if k == 2:  # the same DTensor object, a new local tensor behind it
                p = model.pos
                p._local_tensor = p._local_tensor.detach().clone() * 2 + 1
            if k == 4:  # a new model and optimizer of the same structure (new objects)
                model, optim = w.make_fsdp2(seed=7)
                w.train_step(model, optim, k, rank)
                state = {"model": model, "optimizer": optim}
            refs.append(w.full_state(model, optim))
            handle = bcp.save(f"{root}/s{k}", state, framework="fsdp2", async_save=True,
                              snapshot="overlapped")
            w.train_step(model, optim, 100 + k, rank)  # the live state moves on at once
            cached.append(handle.wait(timeout=120).cached_plan)
            collector_on.append(gc.isenabled())  # the save's pause ends with its copy
    finally:
        pieces_memo.lookup = original
    loaded = [w.fsdp2_load(f"{root}/s{k}", with_extra=False)["state"] for k in range(5)]
    return {"served": served, "cached": cached, "refs": refs, "loaded": loaded,
            "collector_on": collector_on}


def test_fsdp2_saves_reuse_pieces_only_while_the_tensors_are_the_same(world, tmp_path):
    for r in world(2).run(fsdp2_memo_changes, str(tmp_path)):
        # save 0 lists; 1 reuses; 2 sees the swapped local tensor; 3 reuses; 4 has new objects
        assert r["served"] == [False, True, False, True, False], r["served"]
        assert r["cached"] == [False, True, True, True, True], r["cached"]
        assert r["collector_on"] == [True] * 5
        for ref, got in zip(r["refs"], r["loaded"]):
            ref = {k: v for k, v in ref.items() if k != "param_groups"}
            got = {k: v for k, v in got.items() if k != "param_groups"}
            assert_same_state(ref, got)


def test_a_shape_or_dtype_changed_behind_the_same_parameter_lists_the_pieces_again(tmp_path):
    plan_cache.clear()
    pieces_memo.clear()
    model = torch.nn.Linear(64, 32)
    bcp.save(str(tmp_path / "a"), {"model": model})
    model.weight.data = torch.randn(48, 64)  # the same Parameter object, another shape
    model.bias.data = torch.randn(48)
    r = bcp.save(str(tmp_path / "b"), {"model": model})
    assert not r.cached_plan
    fresh = torch.nn.Linear(64, 48)
    bcp.load(str(tmp_path / "b"), {"model": fresh})
    assert same_bits(fresh.weight, model.weight) and same_bits(fresh.bias, model.bias)
    model.weight.data = model.weight.data.double()  # and another dtype
    model.bias.data = model.bias.data.double()
    r = bcp.save(str(tmp_path / "c"), {"model": model})
    assert not r.cached_plan
    fresh = torch.nn.Linear(64, 48).double()
    bcp.load(str(tmp_path / "c"), {"model": fresh})
    assert same_bits(fresh.weight, model.weight) and same_bits(fresh.bias, model.bias)


def test_the_memo_keeps_no_tensor_alive(tmp_path):
    import gc
    import weakref

    pieces_memo.clear()
    model = torch.nn.Linear(256, 256)
    bcp.save(str(tmp_path / "a"), {"model": model})
    gone = weakref.ref(model.weight)
    del model
    gc.collect()
    assert gone() is None
