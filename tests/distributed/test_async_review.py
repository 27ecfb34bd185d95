"""Async saves under events found by review: the saved bytes are the state at ``save()``, bit
for bit, even when training swaps a tensor's data while the save is in flight, and a save
whose wait for the one in flight was cut short (Ctrl-C) never reuses that save's arena."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.engine import async_save, staging
from bytecheckpoint.storage.local import LocalStorage
from tests.support.helpers import same_bits


@contextmanager
def _gate(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> Iterator[threading.Event]:
    """Hold every call of ``cls.name`` until the yielded event is set (at the latest 30 s)."""
    gate = threading.Event()
    original = getattr(cls, name)

    def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        gate.wait(timeout=30)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, held)
    try:
        yield gate
    finally:
        gate.set()


def _frozen_model() -> torch.nn.Module:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    for p in model.parameters():
        p.requires_grad_(False)  # a frozen base model (LoRA): .to() swaps its parameters' .data
    return model


def _loaded(path: str) -> dict[str, torch.Tensor]:
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    bcp.load(path, {"model": fresh})
    return fresh.state_dict()


@pytest.mark.parametrize("through", ["1", "0"], ids=["write-through", "arena"])
def test_data_swapped_during_an_overlapped_save_does_not_reach_it(tmp_path, monkeypatch, through):
    """``model.to(torch.float16)`` and ``p.data = ...`` on frozen parameters right after an
    overlapped save returns, before its write (or copy) ran: the checkpoint holds the values
    of the call (was: the new bytes, or a raw RuntimeError on the size change)."""
    monkeypatch.setenv("BCP_SNAPSHOT_WRITE_THROUGH", through)
    model = _frozen_model()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    cls, name = (LocalStorage, "open_writer") if through == "1" else (staging.Stager, "run")
    with _gate(monkeypatch, cls, name) as gate:
        handle = bcp.save(str(tmp_path / "a"), {"model": model}, async_save=True,
                          snapshot="overlapped")
        model[0].weight.data = torch.zeros(64, 64)  # same size: would be written silently
        model[1].to(torch.float16)  # a size change
        gate.set()
        handle.wait(timeout=60)
    got = _loaded(str(tmp_path / "a"))
    assert [k for k, v in ref.items() if not same_bits(v, got[k])] == []


def test_a_wait_for_the_save_in_flight_cut_short_keeps_it_pending(tmp_path, monkeypatch):
    """Ctrl-C while the next save waits for an async save in flight: the one after must still
    wait for it, not copy into the arena it is writing from (was: the first checkpoint
    committed with the later state's bytes, checksums and all)."""
    model = torch.nn.Linear(256, 256)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ref = model.weight.detach().clone()
    with _gate(monkeypatch, LocalStorage, "open_writer") as gate:
        first = bcp.save(str(tmp_path / "s1"), {"model": model}, async_save=True)
        with torch.no_grad():
            model.weight.fill_(2.0)

        def interrupted(timeout: float | None = None) -> bool:
            raise KeyboardInterrupt

        first._confirm = interrupted  # Ctrl-C inside the wait
        try:
            with pytest.raises(KeyboardInterrupt):
                bcp.save(str(tmp_path / "s2"), {"model": model}, async_save=True)
        finally:
            del first._confirm
        assert async_save._PENDING is first
        threading.Timer(1.0, gate.set).start()  # the next save must wait for this to finish
        bcp.save(str(tmp_path / "s3"), {"model": model}, async_save=True).wait(timeout=60)
    assert first.done() and first.exception() is None
    fresh = torch.nn.Linear(256, 256)
    bcp.load(str(tmp_path / "s1"), {"model": fresh})
    assert same_bits(fresh.weight.detach(), ref)
    bcp.load(str(tmp_path / "s3"), {"model": fresh})
    assert torch.equal(fresh.weight.detach(), torch.full((256, 256), 2.0))



def _child_steps(optim: torch.optim.Optimizer) -> None:
    # Elementwise only: a matmul in a child forked after the parent ran its thread pool may
    # hang in the BLAS library, which is not what this checks.
    optim.step()  # the parent's snapshot may still be copying: must not wait for it here


@pytest.mark.parametrize("snapshot", ["blocking", "overlapped"])
def test_a_process_forked_during_an_async_save_steps_and_exits(tmp_path, monkeypatch, snapshot):
    """A fork-started child (DataLoader worker, ``multiprocessing.Process``) while a save is in
    flight: it inherits the pending save and its snapshot, not the thread that runs them.
    Its optimizer steps and its exit must not wait for them (was: the child hung for ever),
    and the parent's save commits as usual."""
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    with _gate(monkeypatch, LocalStorage, "open_writer") as gate:
        handle = bcp.save(str(tmp_path / "a"), {"model": model}, async_save=True, snapshot=snapshot)
        child = multiprocessing.get_context("fork").Process(target=_child_steps, args=(optim,))
        child.start()
        child.join(timeout=20)
        alive = child.is_alive()
        if alive:
            child.kill()
        gate.set()
        handle.wait(timeout=60)
    assert not alive and child.exitcode == 0
    fresh = torch.nn.Linear(64, 64)
    bcp.load(str(tmp_path / "a"), {"model": fresh})
    assert all(same_bits(v, fresh.state_dict()[k]) for k, v in ref.items())


def test_async_saves_from_two_threads_take_turns(tmp_path, monkeypatch):
    """Two threads of one process each save their own model: the second save's copy must not
    land in the staging arena the first one has yet to write from (was: the first checkpoint
    committed with the second model's values)."""
    first, second = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    torch.nn.init.constant_(first.weight, 1.0)
    torch.nn.init.constant_(second.weight, 2.0)
    copied, release = threading.Event(), threading.Event()
    original = async_save.SaveHandle._start

    def held(self: async_save.SaveHandle, *args: Any, **kwargs: Any) -> None:
        if self.path.endswith("first"):  # copied into the arena, its writer not yet started
            copied.set()
            release.wait(timeout=30)
        original(self, *args, **kwargs)

    monkeypatch.setattr(async_save.SaveHandle, "_start", held)
    errors: list[BaseException] = []

    def save_first() -> None:
        try:
            bcp.save(str(tmp_path / "first"), {"model": first}, async_save=True).wait(timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=save_first)
    thread.start()
    assert copied.wait(timeout=30)
    threading.Timer(1.0, release.set).start()  # the second save must wait for it
    bcp.save(str(tmp_path / "second"), {"model": second}, async_save=True).wait(timeout=60)
    thread.join(timeout=60)
    assert errors == []
    for name, value in (("first", 1.0), ("second", 2.0)):
        fresh = torch.nn.Linear(256, 256)
        bcp.load(str(tmp_path / name), {"model": fresh})
        assert torch.equal(fresh.weight.detach(), torch.full((256, 256), value)), name
