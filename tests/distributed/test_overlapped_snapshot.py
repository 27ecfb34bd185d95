"""``save(..., async_save=True, snapshot="overlapped")`` returns before the copy; the saved bytes
are still the state at the call, bit for bit, whatever training does as early as the contract
allows (issue 21). The functions without ``test_`` run on every rank of a gloo group."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from demo.model import GPTConfig, batch, loss_fn
from tests.support.helpers import same_bits
from tests.support.workloads import full_state, make_fsdp2

# Large enough (~2.8M parameters, 17 MB of state per rank on 2 ranks) that the background
# copy is still running when the caller's next statement executes.
CFG = GPTConfig(vocab_size=4003, context=16, dim=192, heads=4, layers=4)


def _fsdp2(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # AdamW's default weight decay (0.01), on this file's small model
    return make_fsdp2(seed, cfg=CFG, weight_decay=1e-2)


def _backward(model: torch.nn.Module, step: int) -> None:
    inputs, targets = batch(CFG, step, dist.get_rank(), size=2)
    loss_fn(model, inputs, targets).backward()


def _loaded(path: str) -> dict[str, Any]:
    model, optim = _fsdp2(seed=99)
    _backward(model, 0)
    optim.step()  # optimizer state exists to load into
    optim.zero_grad()
    bcp.load(path, {"model": model, "optimizer": optim}, framework="fsdp2")
    return full_state(model, optim)


@contextmanager
def _snapshot_path(through: bool) -> Iterator[None]:
    """In a rank: overlapped saves write from the live tensors (``through``) or copy into the
    arena first (``BCP_SNAPSHOT_WRITE_THROUGH=0``). Both must keep the same promise."""
    os.environ["BCP_SNAPSHOT_WRITE_THROUGH"] = "1" if through else "0"
    try:
        yield
    finally:
        del os.environ["BCP_SNAPSHOT_WRITE_THROUGH"]


PATHS = pytest.mark.parametrize("through", [True, False], ids=["write-through", "arena"])


def _same(ref: dict[str, Any], got: dict[str, Any]) -> list[str]:
    return [k for k, v in ref.items() if isinstance(v, torch.Tensor) and not same_bits(v, got[k])]


def step_right_after_save(root: str, through: bool) -> dict[str, Any]:
    with _snapshot_path(through):
        return _step_right_after_save(root, through)


def _step_right_after_save(root: str, through: bool) -> dict[str, Any]:
    """Gradients are ready when save() is called; the optimizer steps on the very next line."""
    model, optim = _fsdp2(seed=0)
    state = {"model": model, "optimizer": optim}
    for step in range(2):
        _backward(model, step)
        optim.step()
        optim.zero_grad()
    out: dict[str, Any] = {"copy_running": [], "differs": []}
    for k in range(2):  # the first save plans, the second reuses the plan
        _backward(model, 10 + k)
        ref = full_state(model, optim)
        handle = bcp.save(f"{root}/s{k}", state, framework="fsdp2", async_save=True, snapshot="overlapped")
        out["copy_running"].append(not handle.wait_snapshot(timeout=0))
        optim.step()  # changes every parameter and optimizer state: waits for the copy
        optim.zero_grad()
        after = full_state(model, optim)
        result = handle.wait()
        out.setdefault("staged", []).append(result.staging_bytes)
        out["differs"].append(_same(ref, _loaded(f"{root}/s{k}")))
        out.setdefault("stepped", []).append(len(_same(ref, after)))
    return out


def write_after_wait_snapshot(root: str, through: bool) -> dict[str, Any]:
    with _snapshot_path(through):
        return _write_after_wait_snapshot(root, through)


def _write_after_wait_snapshot(root: str, through: bool) -> dict[str, Any]:
    """Any in-place write is allowed once wait_snapshot() has returned."""
    model, optim = _fsdp2(seed=1)
    state = {"model": model, "optimizer": optim}
    _backward(model, 0)
    optim.step()
    optim.zero_grad()
    ref = full_state(model, optim)
    handle = bcp.save(f"{root}/w", state, framework="fsdp2", async_save=True, snapshot="overlapped")
    assert handle.wait_snapshot(timeout=120)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)
        for s in optim.state.values():
            for v in s.values():
                v.add_(7.0)
    handle.wait()
    return {"differs": _same(ref, _loaded(f"{root}/w"))}


def write_without_waiting(root: str, through: bool) -> dict[str, Any]:
    with _snapshot_path(through):
        return _write_without_waiting(root, through)


def _write_without_waiting(root: str, through: bool) -> dict[str, Any]:
    """A no_grad write right after save(), against the contract, fails the save by name:
    whether it landed before, during or after the copy, its counter has moved by the time
    this thread calls wait(), which confirms the snapshot before anything is committed."""
    model, optim = _fsdp2(seed=2)
    state = {"model": model, "optimizer": optim}
    _backward(model, 0)
    optim.step()
    optim.zero_grad()
    ref = full_state(model, optim)
    handle = bcp.save(f"{root}/x", state, framework="fsdp2", async_save=True, snapshot="overlapped")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    try:
        handle.wait()
    except (bcp.SnapshotChangedError, bcp.RankFailedError) as exc:  # here, or on another rank
        return {"error": str(exc), "own": isinstance(exc, bcp.SnapshotChangedError)}
    return {"error": None, "differs": _same(ref, _loaded(f"{root}/x"))}


def _framework_models(kind: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from demo.model import GPT
    from tests.support.frameworks import make_fsdp1, make_tp_dp
    from tests.support.workloads import CFG as WCFG
    from tests.support.workloads import make_fsdp2

    if kind == "ddp":
        torch.manual_seed(seed)
        model: torch.nn.Module = DDP(GPT(WCFG))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if kind.startswith("fsdp1"):
        return make_fsdp1(seed, use_orig_params=kind.endswith("orig"))
    if kind == "tp2":
        return make_tp_dp(seed, dp=1, tp=2)
    return make_fsdp2(seed)


def _canonical(kind: str, model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from tests.support.frameworks import canonical, canonical_fsdp1

    if kind.startswith("fsdp1"):
        return canonical_fsdp1(model, optim)  # type: ignore[arg-type]
    return canonical(model.module if kind == "ddp" else model, optim)


def train_step_right_after_save(root: str, through: bool) -> dict[str, list[str]]:
    with _snapshot_path(through):
        return _train_step_right_after_save(root, through)


def _train_step_right_after_save(root: str, through: bool) -> dict[str, list[str]]:
    """A whole training step (forward, backward, step) right after save(), in every parallel
    layout: forward and backward must leave the saved tensors' counters alone (or the
    confirmation would fail good saves), and the step waits for the copy."""
    from tests.support.workloads import train_step

    tp = "tp2" if dist.get_world_size() == 2 else None
    out: dict[str, list[str]] = {}
    for kind in [k for k in ("ddp", "fsdp1", "fsdp1-orig", "fsdp2", tp) if k is not None]:
        model, optim = _framework_models(kind, seed=0)
        dp_rank = 0 if kind == "tp2" else dist.get_rank()
        train_step(model, optim, 0, dp_rank)
        ref = _canonical(kind, model, optim)
        path = f"{root}/{kind}"
        handle = bcp.save(path, {"model": model, "optimizer": optim}, async_save=True,
                          snapshot="overlapped")
        train_step(model, optim, 1, dp_rank)  # forward and backward overlap the copy
        handle.wait(timeout=120)
        fresh, fresh_optim = _framework_models(kind, seed=7)
        train_step(fresh, fresh_optim, 0, dp_rank)  # optimizer state exists to load into
        bcp.load(path, {"model": fresh, "optimizer": fresh_optim})
        got = _canonical(kind, fresh, fresh_optim)
        out[kind] = [k for k, v in ref.items()
                     if isinstance(v, torch.Tensor) and not same_bits(v, got[k])]
    return out


@PATHS
def test_snapshot_is_the_state_at_save_although_the_optimizer_steps_at_once(world, tmp_path, through):
    results = world(2).run(step_right_after_save, str(tmp_path), through)
    for r in results:
        assert r["differs"] == [[], []]
        assert all((s == 0) == through for s in r["staged"])  # the path the test is about ran
        assert all(n > 0 for n in r["stepped"])  # the step did change the state afterwards
    # the copy was still running when save() returned, at least once on some rank: the
    # optimizer's wait is what kept the step off the tensors
    assert any(any(r["copy_running"]) for r in results)


@PATHS
def test_in_place_writes_after_wait_snapshot_do_not_reach_the_checkpoint(world, tmp_path, through):
    for r in world(2).run(write_after_wait_snapshot, str(tmp_path), through):
        assert r["differs"] == []


@PATHS
def test_unhooked_write_after_save_fails_the_save_by_name(world, tmp_path, through):
    results = world(2).run(write_without_waiting, str(tmp_path), through)
    for r in results:
        assert r["error"] is not None and "wait_snapshot" in r["error"]
    assert all(r["own"] for r in results)  # each rank's own write, not only another rank's
    assert not (tmp_path / "x").exists()


@PATHS
def test_a_training_step_right_after_save_keeps_every_layout_exact(world, tmp_path, through):
    for r in world(2).run(train_step_right_after_save, str(tmp_path), through):
        assert set(r) == {"ddp", "fsdp1", "fsdp1-orig", "fsdp2", "tp2"}
        assert all(v == [] for v in r.values()), r


def _linear() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_write_whose_counter_moves_after_the_copy_fails_the_save(tmp_path):
    """An in-place op writes its data first and bumps its tensor's counter after: a check
    around the copy can miss it. Here the op's data land (through numpy: no counter), the
    copy ends, and only then the counter moves, all before this thread calls bytecheckpoint
    again. The save must fail by name, never commit the written data."""
    model, _ = _linear()
    path = tmp_path / "late"
    handle = bcp.save(str(path), {"model": model}, async_save=True, snapshot="overlapped")
    model.weight.detach().numpy()[...] += 1.0  # the op's data
    assert handle._snapshot is not None and handle._snapshot.done.wait(60)  # the copy is over
    with torch.no_grad():
        model.weight.add_(0.0)  # the op's counter
    with pytest.raises(bcp.SnapshotChangedError, match="weight"):
        handle.wait(timeout=60)
    assert not path.exists()


def test_an_overlapped_save_commits_only_once_training_confirms(tmp_path, monkeypatch):
    """Written, the save waits for training's next call (here a forward of the saved module,
    which has no buffers and so never waits itself) before it commits."""
    model, ref = _linear()
    path = tmp_path / "c"
    handle = bcp.save(str(path), {"model": model}, async_save=True, snapshot="overlapped")
    snap = handle._snapshot
    assert snap is not None and snap.done.wait(60)
    time.sleep(1.0)  # the write of 260 KB is long over; the commit waits for confirmation
    assert not snap.confirmed.is_set() and not handle._future.done()
    model(torch.randn(2, 256))  # confirms: the forward's pre-hook
    assert snap.confirmed.is_set()
    handle._future.result(timeout=60)  # commits without any call on the handle
    fresh, _ = _linear()
    torch.nn.init.zeros_(fresh.weight)
    bcp.load(str(path), {"model": fresh})
    assert all(same_bits(v, ref[k]) for k, v in fresh.state_dict().items())


class _SlowForward(torch.nn.Module):
    """A forward still running when the snapshot is taken (it waits for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(512, 512))
        self.snapshot: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.snapshot.done.wait(60)
        return x @ self.w


@PATHS
def test_a_snapshot_taken_during_forward_is_confirmed_at_its_end(tmp_path, monkeypatch, through):
    """The pre-hook ran before the snapshot was taken, so it could not confirm; the end of the
    same forward does, and the save commits without waiting for the optimizer step."""
    monkeypatch.setenv("BCP_SNAPSHOT_WRITE_THROUGH", "1" if through else "0")
    torch.manual_seed(0)
    model = _SlowForward()
    ref = model.w.detach().clone()
    handle = bcp.save(str(tmp_path / "f"), {"model": model}, async_save=True, snapshot="overlapped")
    model.snapshot = handle._snapshot
    model(torch.randn(2, 512))
    assert handle._snapshot is not None and handle._snapshot.confirmed.is_set()
    result = handle._future.result(timeout=60)  # commits with no call on the handle or step
    assert (result.staging_bytes == 0) == through
    fresh = _SlowForward()
    bcp.load(str(tmp_path / "f"), {"model": fresh})
    assert same_bits(fresh.w, ref)


def test_without_any_call_the_save_checks_alone_after_the_confirm_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("BCP_SNAPSHOT_CONFIRM_S", "0.2")
    model, ref = _linear()
    handle = bcp.save(str(tmp_path / "t"), {"model": model}, async_save=True, snapshot="overlapped")
    handle._future.result(timeout=60)  # nothing of bytecheckpoint called meanwhile
    assert handle._snapshot is not None and handle._snapshot.confirmed.is_set()
    fresh, _ = _linear()
    torch.nn.init.zeros_(fresh.weight)
    bcp.load(str(tmp_path / "t"), {"model": fresh})
    assert all(same_bits(v, ref[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan"])
def test_a_bad_confirm_timeout_fails_save_before_anything_runs(tmp_path, monkeypatch, value):
    monkeypatch.setenv("BCP_SNAPSHOT_CONFIRM_S", value)
    model, _ = _linear()
    with pytest.raises(bcp.InvalidArgumentError, match="BCP_SNAPSHOT_CONFIRM_S"):
        bcp.save(str(tmp_path / "b"), {"model": model}, async_save=True, snapshot="overlapped")
    assert not (tmp_path / "b").exists()


class _WithBatchNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(4096, 4096))  # 64 MB, copied first (by name)
        self.bn = torch.nn.BatchNorm1d(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x)


def _bn_model() -> torch.nn.Module:
    return _WithBatchNorm()


def test_forward_of_a_module_with_buffers_waits_for_the_copy(tmp_path):
    """BatchNorm updates its running statistics in forward: the saved ones are those of the call."""
    torch.manual_seed(0)
    model = _bn_model().train()
    model(torch.randn(8, 64))
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    handle = bcp.save(str(tmp_path / "bn"), {"model": model}, async_save=True, snapshot="overlapped")
    model(torch.randn(8, 64) + 5.0)  # moves running_mean / running_var / num_batches_tracked
    assert not same_bits(model.bn.running_mean, ref["bn.running_mean"])
    handle.wait(timeout=120)
    fresh = _bn_model()
    bcp.load(str(tmp_path / "bn"), {"model": fresh})
    assert all(same_bits(v, ref[k]) for k, v in fresh.state_dict().items())


def test_snapshot_argument_is_checked(tmp_path):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(bcp.InvalidArgumentError, match="snapshot mode"):
        bcp.save(str(tmp_path / "a"), {"model": model}, async_save=True, snapshot="lazy")
    with pytest.raises(bcp.InvalidArgumentError, match="async_save=True"):
        bcp.save(str(tmp_path / "b"), {"model": model}, snapshot="overlapped")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    handle = bcp.save(str(tmp_path / "c"), {"model": model}, async_save=True)  # blocking: copied already
    assert handle.wait_snapshot(timeout=0)
    handle.wait(timeout=60)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the side-stream copy")
def test_cuda_side_stream_snapshot_is_the_state_at_save(tmp_path):
    """On CUDA the copy runs on a side stream into pinned memory; the optimizer step's kernels
    are queued behind it, so the saved bytes are those of the call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(16, 2048, device="cuda")).square().mean().backward()
        optim.step()
        optim.zero_grad()
    model(torch.randn(16, 2048, device="cuda")).square().mean().backward()
    state = {"model": model, "optimizer": optim}
    ref = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    handle = bcp.save(str(tmp_path / "g"), state, async_save=True, snapshot="overlapped")
    optim.step()
    handle.wait(timeout=300)
    fresh = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    bcp.load(str(tmp_path / "g"), {"model": fresh}, strict=False)
    assert all(same_bits(v.cpu(), ref[k]) for k, v in fresh.state_dict().items())


def test_a_capturable_optimizer_gets_the_cuda_graph_rule(tmp_path):
    """A step replayed from a CUDA graph runs no hook: the save says what to do instead."""
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters(), capturable=True)
    with pytest.warns(RuntimeWarning, match="capturable=True.*wait_snapshot"):
        handle = bcp.save(str(tmp_path / "c"), {"model": model, "optimizer": optim},
                          async_save=True, snapshot="overlapped")
    handle.wait(timeout=60)
    plain = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        bcp.save(str(tmp_path / "d"), {"model": model, "optimizer": plain},
                 async_save=True, snapshot="overlapped").wait(timeout=60)
