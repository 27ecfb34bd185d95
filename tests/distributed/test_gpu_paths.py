"""The CUDA and NCCL paths on real GPUs (issue 22). Run with ``pytest -m gpu`` (docs/gpu.md).

Skipped, with the reason, where there are not enough GPUs; always collected, so they cannot
rot unnoticed. What can be checked without a GPU is in tests/distributed/test_gpu_logic_cpu.py.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.support import gpu_review_workloads as rw
from tests.support import gpu_workloads as g
from tests.support.dist import free_port
from tests.support.helpers import assert_same_state

pytestmark = pytest.mark.gpu


def needs_gpus(n: int, purpose: str) -> pytest.MarkDecorator:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < n, reason=f"needs {n} GPU(s), found {have}: {purpose}")


def _nccl_run(world: int, fn: Any, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` fresh NCCL ranks (rank r on cuda:r); a hang fails."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=g.nccl_worker,
                         args=(r, world, port, (fn.__module__, fn.__name__, args), results))
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                silent = sorted(set(range(world)) - set(out))
                pytest.fail(f"{fn.__name__} hung: no answer from ranks {silent}")
            if not ok:
                pytest.fail(f"{fn.__name__} failed on rank {rank}:\n{value}")
            out[rank] = pickle.loads(value)  # the test's own worker's bytes
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


# -- staging: the copy waits for the caller's work, on the tensors' own device -------------


@needs_gpus(2, "a save of tensors on cuda:1, where a staging thread on cuda:0 copied unsynchronised")
@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("set_device", [False, True])
def test_save_of_tensors_on_the_second_gpu_is_exact(tmp_path, set_device, async_save):
    assert g.cuda_save_roundtrip(str(tmp_path / "c"), 1, set_device, async_save)


@needs_gpus(1, "a save right after pending work on the caller's (default or side) stream")
@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("side_stream", [False, True])
def test_save_waits_for_the_callers_stream(tmp_path, side_stream, async_save):
    assert g.cuda_save_after_pending_work(str(tmp_path / "c"), side_stream, async_save)


@needs_gpus(2, "ranks on cuda:0 and cuda:1 saving and loading over gloo")
@pytest.mark.parametrize("async_save", [False, True])
def test_two_ranks_on_two_gpus(world, tmp_path, async_save):
    results = world(2).run(g.cuda_rank_roundtrip, str(tmp_path / "c"), async_save)
    assert results == [True, True]


@needs_gpus(2, "pinned staging of tensors on cuda:1, in a process that never called set_device")
def test_pinning_makes_no_context_on_gpu_0(tmp_path):
    """Saves and a load of tensors on cuda:1 pin their host arenas (blocking and overlapped
    staging, the load's windows) on cuda:1: a context on GPU 0 would cost every such rank of
    the host hundreds of MiB there. In a fresh process, so nothing before touched GPU 0."""
    out = subprocess.run([sys.executable, "-c", g.PIN_DEVICE_SCRIPT, str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "exact=True pinned=True context-on-0=False", out.stdout


@needs_gpus(2, "replica samples of tensors on cuda:1 digested on a thread current on cuda:0")
def test_replica_digests_make_no_context_on_gpu_0():
    """The events after the sampling kernels are waited for on their own device: on the
    thread's (a save's worker starts on cuda:0) the wait created a context on GPU 0."""
    out = subprocess.run([sys.executable, "-c", rw.REPLICA_DEVICE_SCRIPT],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "exact=True context-on-0=False", out.stdout


@needs_gpus(1, "the pinned staging arena: exact size, outside the caching host allocator")
def test_pinned_arena_after_growth(tmp_path):
    got = g.pinned_bytes_after_growth(str(tmp_path))
    assert got["pinned"] == 1
    assert got["capacity"] == 20 << 20  # exactly what the larger save needs, not 32 MiB
    assert got["host_cache"] == 0  # no block of the old arena kept pinned in the cache


# -- NCCL loads ---------------------------------------------------------------------------

CASES = [("ddp", False, False), ("ddp", False, True), ("fsdp2", False, False),
         ("fsdp2", False, True), ("fsdp2", True, False)]


@pytest.mark.parametrize("framework,offload,fused", CASES)
@pytest.mark.parametrize("saved,loaded", [(2, 2), (2, 3), (4, 2)])
def test_nccl_load(tmp_path, framework, offload, fused, saved, loaded):
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < max(saved, loaded):
        pytest.skip(f"needs {max(saved, loaded)} GPUs, found {have}: NCCL load of {framework} "
                    f"with AdamW (fused={fused}, offload={offload}) from {saved} to {loaded} ranks")
    root = str(tmp_path / "c")
    expected = _nccl_run(saved, g.nccl_save, root, framework, offload, fused)[0]
    results = _nccl_run(loaded, g.nccl_load, root, framework, offload, fused)
    # NCCL unless a rank has no CUDA tensor (CPU offload): then every rank uses gloo
    assert {r["transport"] for r in results} == {"gloo" if offload else "nccl"}
    for r in results:
        assert_same_state(expected, r["state"])


@needs_gpus(2, "an NCCL load into buffers freed by the caller with writes still pending on them")
def test_nccl_load_waits_for_the_callers_pending_writes(tmp_path):
    root = str(tmp_path / "c")
    expected = _nccl_run(2, g.nccl_save, root, "ddp", False, False)[0]
    for r in _nccl_run(2, g.nccl_load_behind_pending_writes, root):
        assert r["transport"] == "nccl"
        assert_same_state(expected, r["state"])


@needs_gpus(2, "an NCCL load into TensorShard targets (FSDP1 and Megatron states flatten to these)")
def test_nccl_load_of_tensor_shards(tmp_path):
    results = _nccl_run(2, rw.tensor_shards_swapped, str(tmp_path / "c"))
    assert results == [{"transport": "nccl", "exact": True}] * 2, results


@needs_gpus(3, "an NCCL load as the group's first operation, with ranks that post nothing")
def test_nccl_load_as_the_groups_first_operation(tmp_path):
    root = str(tmp_path / "c")
    expected = _nccl_run(2, g.nccl_save, root, "fsdp2", False, False)[0]
    results = _nccl_run(3, g.nccl_load, root, "fsdp2", False, False)  # resharded: uneven plan
    for r in results:
        assert_same_state(expected, r["state"])


@needs_gpus(2, "an out-of-memory error inside the NCCL load window, raised on every rank")
def test_oom_in_the_nccl_window_fails_every_rank(tmp_path):
    root = str(tmp_path / "c")
    _nccl_run(2, g.nccl_save, root, "fsdp2", False, False)
    results = _nccl_run(2, g.nccl_load_with_oom, root, 1, timeout=120)
    assert all(r["raised"] is not None and r["raised"][1] for r in results), results
    assert all(r["after"] == 2 for r in results)


@needs_gpus(4, "a save and load on an NCCL subgroup called by its members only")
def test_load_on_an_nccl_subgroup(tmp_path):
    results = _nccl_run(4, g.nccl_subgroup_roundtrip, str(tmp_path / "c"))
    assert results == [True, True, None, None]


# -- overlapped snapshots and NCCL loads on one GPU -----------------------------------------


@needs_gpus(1, "an overlapped save's D2H copy against GPU work queued after save() returned")
def test_overlapped_copy_does_not_wait_for_work_queued_after_save(tmp_path):
    got = g.overlapped_copy_ahead_of_later_work(str(tmp_path / "c"))
    assert got["snapshot_done"] and got["exact"]
    # the copy waited for the caller's work at save(), not for the 2 s kernel queued after it
    assert got["later_work_running"], "the snapshot waited for work queued after save()"


@needs_gpus(1, "an overlapped save of a CUDA model with AdamW stepping on the next line")
@pytest.mark.parametrize("cap", [None, 4 << 20], ids=["arena", "bounded-4MiB"])
def test_overlapped_cuda_snapshot_is_the_state_at_save(tmp_path, cap):
    got = g.overlapped_step_right_after_save(str(tmp_path / "c"), cap)
    assert got["moved_after_save"] > 0  # the steps after save() changed the live state
    assert got["compared"] == 6 * 2 + 6 * 2 * 3  # the model, then AdamW's step, exp_avg, exp_avg_sq
    assert got["differs"] == []
    if cap is not None:
        assert 0 < got["staging_bytes"] <= cap


@needs_gpus(1, "a failed save's queued D2H copies against the pinned arena the next save reuses")
@pytest.mark.parametrize("cap", [None, 4 << 20], ids=["arena", "bounded-4MiB"])
def test_a_failed_save_leaves_no_copy_landing_in_the_arena(tmp_path, cap):
    got = g.failed_save_leaves_no_copy_running(str(tmp_path / "c"), cap)
    assert got["raised"] == "CheckpointExistsError" and got["pinned"] and got["arena_bytes"] > 0
    assert got["intact"], "a copy of the failed save landed in the arena after wait() raised"


@needs_gpus(1, "600 small CUDA tensors through a bounded arena, their copies queued in groups")
def test_grouped_copies_through_a_small_bounded_arena_are_exact(tmp_path):
    got = g.many_small_tensors_through_a_small_ring(str(tmp_path / "c"))
    assert 0 < got["staging_bytes"] <= got["cap"]
    assert got["differs"] == []


ONE_GPU_CASES = [("fsdp2", False, True), ("ddp", False, False), ("fsdp2", True, False)]


@needs_gpus(1, "an NCCL save and load on a world of one GPU")
@pytest.mark.parametrize("framework,offload,fused", ONE_GPU_CASES)
def test_nccl_load_on_one_gpu(tmp_path, framework, offload, fused):
    root = str(tmp_path / "c")
    expected = _nccl_run(1, g.nccl_save, root, framework, offload, fused)[0]
    [result] = _nccl_run(1, g.nccl_load, root, framework, offload, fused)
    assert result["transport"] == ("gloo" if offload else "nccl")
    assert_same_state(expected, result["state"])
