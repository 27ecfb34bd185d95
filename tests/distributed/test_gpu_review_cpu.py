"""Findings of a review of the CUDA paths, checked without a GPU.

- A load on an NCCL training group asks every target for its CUDA device; ``TensorShard``
  and ``ShardSet`` targets (FSDP1, Megatron, ``bcp.TensorShard``) have no ``is_cuda``, and
  such a load failed on every rank with an AttributeError.
- Loads into CUDA targets read every box into the load pool's pinned window arena; two
  threads loading at once read into the same memory, and one copied the other's bytes into
  its targets (silently, checksums included: they were checked before the overwrite).
- ``event.synchronize()`` makes a CUDA runtime call on the thread's current device, which
  creates a context there (hundreds of MiB) when that device is not the event's: the
  replica samples' events were waited for on whatever device the save's thread was on.
"""

from __future__ import annotations

import ast
import threading
import warnings

import torch

import bytecheckpoint as bcp
from bytecheckpoint.engine import load as load_mod
from bytecheckpoint.engine import load_pipeline
from bytecheckpoint.runtime import devices
from bytecheckpoint.state.tensor_shard import ShardSet, TensorShard
from tests.distributed.test_gpu_logic_cpu import _chain, _is_guard, _package_modules
from tests.support import gpu_review_workloads as w


def test_an_nccl_load_of_tensor_shards_chooses_its_transport(world, tmp_path):
    results = world(2).run(w.load_shards_on_an_nccl_group, str(tmp_path / "c"))
    assert results == [{"transport": "gloo", "exact": True}] * 2, results


def test_held_tensors_unwrap_shards_and_shard_sets():
    a, b, c, d = (torch.zeros(2) for _ in range(4))
    pieces = ShardSet((TensorShard(a, (4,), (0,)), TensorShard(b, (4,), (2,))))
    got = load_mod._held_tensors([pieces, TensorShard(c, (2,)), d])
    assert [t is x for t, x in zip(got, (a, b, c, d), strict=True)] == [True] * 4


def test_loads_on_two_threads_into_cuda_targets_use_their_own_windows(tmp_path, monkeypatch):
    """Thread A stops before its first copy out of the window arena while thread B loads
    another checkpoint of the same layout; A's targets must get A's bytes."""
    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))

    saved = []
    for seed in range(2):
        saved.append(model(seed).state_dict())
        bcp.save(str(tmp_path / f"c{seed}"), {"model": model(seed)})
    monkeypatch.setattr(devices, "PRETEND_CUDA_TARGETS", True)  # boxes go through the arena
    monkeypatch.setenv("BCP_LOAD_EARLY", "0")  # no early reads: CUDA targets have none
    at_copy, b_done = threading.Event(), threading.Event()
    copy_out = load_pipeline.copy_out

    def held(read: load_pipeline.BoxRead, non_blocking: bool = False) -> None:
        if threading.current_thread().name == "A" and not at_copy.is_set():
            at_copy.set()
            b_done.wait(60)
        copy_out(read, non_blocking)

    monkeypatch.setattr(load_pipeline, "copy_out", held)
    into = [model(7), model(7)]
    errors: list[BaseException] = []

    def load(i: int) -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # no CUDA here: the arena is not pinned
                bcp.load(str(tmp_path / f"c{i}"), {"model": into[i]})
        except BaseException as exc:
            errors.append(exc)
        finally:
            if i == 1:
                b_done.set()

    a = threading.Thread(target=load, args=(0,), name="A")
    a.start()
    assert at_copy.wait(60)
    load(1)
    a.join(60)
    assert not errors, errors
    for got, want in zip(into, saved, strict=True):
        assert all(torch.equal(v, want[k]) for k, v in got.state_dict().items())


# -- static check: events are waited for on their own device -------------------------------


def _unguarded_synchronizes(modules: dict[str, ast.Module]) -> tuple[list[str], int]:
    """``x.synchronize()`` calls not made inside ``on_device(...)`` / ``torch.cuda.device(...)``
    in their own function. (``torch.cuda.Event.synchronize`` sets no device itself.)"""
    problems, seen = [], 0

    def scan(node: ast.AST, guarded: bool, path: str) -> None:
        nonlocal seen
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            guarded = False  # a nested function runs wherever it is called from
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(_is_guard(i) for i in node.items):
            guarded = True
        if isinstance(node, ast.Call):
            chain = _chain(node.func)
            if len(chain) > 1 and chain[-1] == "synchronize" and chain[:2] != ["torch", "cuda"]:
                seen += 1
                if not guarded:
                    problems.append(f"{path}:{node.lineno}: {ast.unparse(node.func)}()")
        for child in ast.iter_child_nodes(node):
            scan(child, guarded, path)

    for path, tree in modules.items():
        scan(tree, False, path)
    return problems, seen


def test_every_synchronize_runs_on_its_device():
    problems, seen = _unguarded_synchronizes(_package_modules())
    assert seen >= 6, "the scan found too few synchronize() calls: it is not looking"
    assert not problems, "synchronize() outside a device guard:\n" + "\n".join(problems)


def test_the_static_check_catches_a_synchronize_off_its_device():
    bad = ast.parse(
        "def digests(ready):\n"
        "    for event in ready:\n"
        "        event.synchronize()\n"
        "def fine(ready):\n"
        "    for device, event in ready:\n"
        "        with torch.cuda.device(device):\n"
        "            event.synchronize()\n"
        "def later(ready, dev):\n"
        "    with on_device(dev):\n"
        "        def inner():\n"
        "            ready.synchronize()\n"
        "        return inner\n")
    problems, seen = _unguarded_synchronizes({"bad.py": bad})
    assert seen == 3 and len(problems) == 2, problems
