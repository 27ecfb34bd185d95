"""``save(..., async_save=True, snapshot="overlapped")`` returns before the copy; the saved bytes
are still the state at the call, bit for bit, whatever training does as early as the contract
allows (issue 21). The functions without ``test_`` run on every rank of a gloo group."""

from __future__ import annotations

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


def _same(ref: dict[str, Any], got: dict[str, Any]) -> list[str]:
    return [k for k, v in ref.items() if isinstance(v, torch.Tensor) and not same_bits(v, got[k])]


def step_right_after_save(root: str) -> dict[str, Any]:
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
        handle.wait()
        out["differs"].append(_same(ref, _loaded(f"{root}/s{k}")))
        out.setdefault("stepped", []).append(len(_same(ref, after)))
    return out


def write_after_wait_snapshot(root: str) -> dict[str, Any]:
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


def write_without_waiting(root: str) -> dict[str, Any]:
    """A no_grad write right after save(), against the contract: the save is either the exact
    state of the call (the copy won the race) or fails by name; never a mix."""
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
        return {"error": str(exc)}
    return {"error": None, "differs": _same(ref, _loaded(f"{root}/x"))}


def test_snapshot_is_the_state_at_save_although_the_optimizer_steps_at_once(world, tmp_path):
    results = world(2).run(step_right_after_save, str(tmp_path))
    for r in results:
        assert r["differs"] == [[], []]
        assert all(n > 0 for n in r["stepped"])  # the step did change the state afterwards
    # the copy was still running when save() returned, at least once on some rank: the
    # optimizer's wait is what kept the step off the tensors
    assert any(any(r["copy_running"]) for r in results)


def test_in_place_writes_after_wait_snapshot_do_not_reach_the_checkpoint(world, tmp_path):
    for r in world(2).run(write_after_wait_snapshot, str(tmp_path)):
        assert r["differs"] == []


def test_unhooked_write_racing_the_copy_fails_by_name_or_saves_the_exact_state(world, tmp_path):
    for r in world(2).run(write_without_waiting, str(tmp_path)):
        if r["error"] is not None:
            assert "wait_snapshot" in r["error"]
            assert not (tmp_path / "x").exists()
        else:
            assert r["differs"] == []


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
