"""A forked child holding its parent's async save handle: asking it about the save is a named
error, not a wait that never ends (the thread running the save stayed in the parent)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from bytecheckpoint.engine.async_save import SaveHandle
from bytecheckpoint.errors import InvalidArgumentError

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _ask(handle: SaveHandle, call: str, answers) -> None:
    try:
        getattr(handle, call)()
        answers.put("returned")
    except InvalidArgumentError as exc:
        answers.put(f"named: {exc}")
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        answers.put(f"other: {exc!r}")


@pytest.mark.parametrize("call", ["wait", "exception", "done", "wait_snapshot"])
def test_a_forked_child_cannot_wait_for_its_parents_save(call: str) -> None:
    handle = SaveHandle("/ckpt/step-7", 7)  # never finishes: its save runs nowhere
    ctx = mp.get_context("fork")
    answers = ctx.Queue()
    child = ctx.Process(target=_ask, args=(handle, call, answers))
    child.start()
    child.join(timeout=30)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung, f"handle.{call}() in a forked child waited for a save it cannot see"
    answer = answers.get(timeout=5)
    assert answer.startswith("named: "), answer
    assert "/ckpt/step-7" in answer and f"process {os.getpid()}" in answer


def test_a_finished_save_is_still_answered_in_a_forked_child(tmp_path) -> None:
    handle = SaveHandle(str(tmp_path), 3)
    handle._future.set_result("committed")
    ctx = mp.get_context("fork")
    answers = ctx.Queue()
    child = ctx.Process(target=_ask, args=(handle, "wait", answers))
    child.start()
    child.join(timeout=30)
    assert answers.get(timeout=5) == "returned"


def test_the_parent_still_waits_for_its_own_save() -> None:
    handle = SaveHandle("/ckpt/step-1", 1)
    assert handle.done() is False
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.01)
    assert "running" in repr(handle)
