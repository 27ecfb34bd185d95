"""Rank functions for tests/distributed/test_gpu_logic_cpu.py: the GPU paths' logic, run on gloo ranks.

Each function restores whatever it patched before it returns, since the pool's processes run
many tests."""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.engine import load_pipeline, staging
from bytecheckpoint.runtime import devices
from bytecheckpoint.runtime.comm import Communicator, Outcome
from tests.support import workloads as w


def _model_and_adam(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small replicated model with AdamW after one step: its ``step`` is a CPU scalar that
    every rank holds, the tensor NCCL loads used to pass to NCCL as a host tensor."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 24), nn.Linear(24, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).sum().backward()
    optim.step()
    return model, optim


def _values(model: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    for s in optim.state.values():
        out += [v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def save_replicated(root: str) -> None:
    model, optim = _model_and_adam(seed=0)
    bcp.save(root, {"model": model, "optimizer": optim}, framework="ddp", overwrite=True)


def load_pretending(root: str, pretend_ranks: list[int]) -> dict[str, Any]:
    """Load on every rank; the ranks in ``pretend_ranks`` say they hold CUDA targets on an
    NCCL group (the test seam), the others have none."""
    ref_model, ref_optim = _model_and_adam(seed=0)
    model, optim = _model_and_adam(seed=7)
    devices.PRETEND_CUDA = dist.get_rank() in pretend_ranks
    try:
        t = time.monotonic()
        result = bcp.load(root, {"model": model, "optimizer": optim}, framework="ddp")
        elapsed = time.monotonic() - t
    finally:
        devices.PRETEND_CUDA = False
    same = all(torch.equal(a, b) for a, b in zip(_values(ref_model, ref_optim), _values(model, optim)))
    return {"transport": result.transport, "same": same, "elapsed": elapsed}


def load_with_failed_allocation(root: str, failing_rank: int, pretend: bool) -> dict[str, Any]:
    """One rank cannot allocate its window's buffers (as a CUDA OOM would): every rank must
    raise a named error, promptly, and the group must stay usable."""
    model, optim = _model_and_adam(seed=7)
    original = load_pipeline.LoadPipeline._allocate

    def out_of_memory(self: Any, *args: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    if dist.get_rank() == failing_rank:
        load_pipeline.LoadPipeline._allocate = out_of_memory  # type: ignore[method-assign]
    devices.PRETEND_CUDA = pretend
    t = time.monotonic()
    try:
        bcp.load(root, {"model": model, "optimizer": optim}, framework="ddp")
        raised = None
    except Exception as exc:
        raised = (type(exc).__name__, isinstance(exc, bcp.CheckpointError), str(exc))
    finally:
        load_pipeline.LoadPipeline._allocate = original  # type: ignore[method-assign]
        devices.PRETEND_CUDA = False
    elapsed = time.monotonic() - t
    dist.barrier()  # the group still works: nobody is left inside an exchange
    return {"raised": raised, "elapsed": elapsed}


def async_save_with_failed_arena(root: str, failing_rank: int) -> dict[str, Any]:
    """The staging arena cannot be allocated on one rank: every rank raises a named error
    within the timeout instead of waiting in the commit round."""
    model, optim = _model_and_adam(seed=0)
    original = staging.HostBufferPool.reserve

    def no_memory(self: Any, nbytes: int) -> torch.Tensor:
        raise MemoryError(f"cannot allocate {nbytes} bytes (injected)")

    if dist.get_rank() == failing_rank:
        staging.HostBufferPool.reserve = no_memory  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    t = time.monotonic()
    try:
        try:
            handle = bcp.save(root, {"model": model, "optimizer": optim}, framework="ddp",
                              async_save=True, overwrite=True)
            handle.wait(timeout=60)
            out["raised"] = None
        except Exception as exc:
            out["raised"] = (type(exc).__name__, isinstance(exc, bcp.CheckpointError), str(exc))
    finally:
        staging.HostBufferPool.reserve = original  # type: ignore[method-assign]
    out["elapsed"] = time.monotonic() - t
    dist.barrier()
    return out


def twin_of_subgroup(pretend_backend: str) -> list[int] | None:
    """Only ranks 0 and 1 load on their subgroup (its other ranks have nothing to do with
    it), so only they build a Communicator on it, which takes a gloo twin of a non-gloo
    group. Afterwards every rank makes a group together, as training code does: that only
    works if making the twin left no trace on the ranks outside it."""
    rank = dist.get_rank()
    sub = dist.new_group([0, 1], backend="gloo", use_local_synchronization=True,
                         timeout=timedelta(seconds=30))
    gathered = None
    if rank < 2:
        original = dist.get_backend

        def backend(group: Any = None) -> str:
            return pretend_backend if group is sub else original(group)

        dist.get_backend = backend  # type: ignore[assignment]
        try:
            gathered = [o.value for o in Communicator(sub).all_gather(Outcome(value=rank))]
        finally:
            dist.get_backend = original  # type: ignore[assignment]
    everyone = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    dist.barrier(group=everyone)
    return gathered


# -- on GPUs (tests/distributed/test_gpu_paths.py) ------------------------------------------------------


def nccl_worker(rank: int, world: int, port: int, task: tuple[str, str, tuple], results: Any) -> None:
    """One rank of an NCCL world (started by test_gpu_paths._nccl_run): runs ``task`` and
    reports (rank, ok, value or traceback)."""
    import importlib
    import os
    import traceback

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    module, name, args = task
    try:
        value = getattr(importlib.import_module(module), name)(*args)
        # Plain pickle bytes: a tensor put on the queue as is travels as a file descriptor
        # that this process must still serve when the parent reads it, after it has exited.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _cuda_state(device: torch.device, seed: int, mb: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    n = mb * (1 << 20) // 4
    return {"big": torch.randn(n, device=device, generator=g),
            "half": torch.randn(1000, 37, device=device, generator=g).half(),
            "view": torch.randn(64, 64, device=device, generator=g)[:, 3:40],  # not contiguous
            "empty": torch.empty(0, device=device)}


def _as_module(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """``tensors`` as the buffers of a module: a module's tensors are saved one by one, through
    the staging arena (a plain dict would be saved as one packed object)."""
    holder = nn.Module()
    for k, v in tensors.items():
        holder.register_buffer(f"t_{k}", v)  # "half" alone would clash with Module.half
    return holder


def cuda_save_roundtrip(root: str, device_index: int, set_device: bool, async_save: bool) -> bool:
    """Save tensors on ``cuda:device_index`` (with or without set_device in the caller),
    clobber them as soon as save returns, and load them back bit for bit."""
    device = torch.device("cuda", device_index)
    if set_device:
        torch.cuda.set_device(device)
    state = _cuda_state(device, seed=1)
    expected = {k: v.cpu().clone() for k, v in state.items()}
    out = bcp.save(root, {"model": _as_module(state)}, async_save=async_save, overwrite=True)
    for v in state.values():
        v.fill_(7)  # training goes on
    if async_save:
        out.wait()  # type: ignore[union-attr]
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(root, {"model": _as_module(into)})
    return all(torch.equal(into[k].cpu(), expected[k]) for k in expected)


def cuda_save_after_pending_work(root: str, side_stream: bool, async_save: bool) -> bool:
    """The values exist only once the caller's stream runs: a long ``torch.cuda._sleep``,
    then the fill that makes them. Save right away, clobber right after; the checkpoint must
    hold the filled values (the copy waited for the caller's stream)."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.zeros(16 << 20, device=device)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the fill runs
        x.fill_(3.0)
        out = bcp.save(root, {"model": _as_module({"x": x})}, async_save=async_save, overwrite=True)
        x.fill_(-1.0)
    if async_save:
        out.wait()  # type: ignore[union-attr]
    torch.cuda.synchronize()
    into = {"x": torch.zeros_like(x)}
    bcp.load(root, {"model": _as_module(into)})
    return bool((into["x"] == 3.0).all().item())


def pinned_bytes_after_growth(root: str) -> dict[str, int]:
    """Two saves, the second larger: the staging arena is pinned at its exact size and the
    caching host allocator holds nothing for it."""
    staging.release_pools()  # an earlier test's larger save may have grown the arena
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    device = torch.device("cuda", torch.cuda.current_device())
    bcp.save(f"{root}/a", {"model": _as_module({"x": torch.ones(3 << 20, device=device)})})  # 12 MiB
    bcp.save(f"{root}/b", {"model": _as_module({"x": torch.ones(5 << 20, device=device)})})  # 20 MiB
    pool = staging.pool(True)
    return {"capacity": pool.capacity, "pinned": int(pool.is_pinned),
            "host_cache": torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before}


def _fsdp2(seed: int, offload: bool, fused: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(96, 130), nn.ReLU(), nn.Linear(130, 7)).cuda()
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    kw: dict[str, Any] = {"mesh": mesh}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)


def _ddp(seed: int, offload: bool, fused: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    model = DDP(nn.Sequential(nn.Linear(96, 130), nn.ReLU(), nn.Linear(130, 7)).cuda())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)


def _train(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    torch.manual_seed(5)
    inputs = torch.randn(8, 96, device="cuda")
    model(inputs).square().sum().backward()
    optim.step()
    optim.zero_grad()


def nccl_save(root: str, framework: str, offload: bool, fused: bool) -> list[torch.Tensor]:
    make = _fsdp2 if framework == "fsdp2" else _ddp
    model, optim = make(0, offload, fused)
    _train(model, optim)
    bcp.save(root, {"model": model, "optimizer": optim}, framework=framework, overwrite=True)
    return w.full_state(model, optim)


def nccl_load(root: str, framework: str, offload: bool, fused: bool) -> dict[str, Any]:
    make = _fsdp2 if framework == "fsdp2" else _ddp
    model, optim = make(9, offload, fused)
    _train(model, optim)  # creates the optimizer state (step is a CPU scalar unless fused)
    result = bcp.load(root, {"model": model, "optimizer": optim}, framework=framework)
    return {"transport": result.transport, "state": w.full_state(model, optim)}


def nccl_load_behind_pending_writes(root: str) -> dict[str, Any]:
    """A DDP load (every box read by one rank and sent to the other) right after the caller
    queued writes into memory it then freed: the blocks go back to the caching allocator with
    their writes still pending behind ~1 s of GPU work, and the load's device buffers may be
    those blocks. The staged copies into them (on the load's side stream) must wait for the
    pending writes, or those writes land over the loaded bytes."""
    model, optim = _ddp(9, False, False)
    _train(model, optim)
    torch.cuda._sleep(2_000_000_000)
    scratch = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in range(512, 64 << 10, 512)]
    for t in scratch:
        t.fill_(0xEE)  # queued behind the sleep
    del scratch, t
    result = bcp.load(root, {"model": model, "optimizer": optim}, framework="ddp")
    return {"transport": result.transport, "state": w.full_state(model, optim)}


def nccl_load_with_oom(root: str, failing_rank: int) -> dict[str, Any]:
    model, optim = _fsdp2(9, False, False)
    _train(model, optim)
    original = load_pipeline.LoadPipeline._allocate

    def out_of_memory(self: Any, *args: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    if dist.get_rank() == failing_rank:
        load_pipeline.LoadPipeline._allocate = out_of_memory  # type: ignore[method-assign]
    try:
        bcp.load(root, {"model": model, "optimizer": optim}, framework="fsdp2")
        raised = None
    except Exception as exc:
        raised = (type(exc).__name__, isinstance(exc, bcp.CheckpointError))
    finally:
        load_pipeline.LoadPipeline._allocate = original  # type: ignore[method-assign]
    ok = torch.ones(1, device="cuda")
    dist.all_reduce(ok)  # NCCL is still usable: nobody is stuck in the exchange
    return {"raised": raised, "after": int(ok.item())}


def nccl_subgroup_roundtrip(root: str) -> bool | None:
    """Ranks 0 and 1 save and load on their NCCL subgroup; the other ranks never call."""
    sub = dist.new_group([0, 1], backend="nccl", use_local_synchronization=True)
    result = None
    if dist.get_rank() < 2:
        state = {"w": torch.arange(1000.0, device="cuda")}
        bcp.save(root, {"model": state}, process_group=sub, framework="ddp", overwrite=True)
        into = {"w": torch.zeros(1000, device="cuda")}
        bcp.load(root, {"model": into}, process_group=sub, framework="ddp")
        result = bool(torch.equal(into["w"], torch.arange(1000.0, device="cuda")))
    dist.barrier()
    return result


def cuda_rank_roundtrip(root: str, async_save: bool) -> bool:
    """Rank r of a gloo world keeps its tensors on cuda:r without calling set_device."""
    device = torch.device("cuda", dist.get_rank())
    state = _cuda_state(device, seed=3, mb=16)  # replicated: the same values on every rank
    expected = {k: v.cpu().clone() for k, v in state.items()}
    out = bcp.save(root, {"model": _as_module(state)}, framework="ddp", async_save=async_save,
                   overwrite=True)
    for v in state.values():
        v.fill_(7)
    if async_save:
        out.wait()  # type: ignore[union-attr]
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(root, {"model": _as_module(into)}, framework="ddp")
    return all(torch.equal(into[k].cpu(), expected[k]) for k in expected)


# Run as ``python -c PIN_DEVICE_SCRIPT ROOT`` (a fresh process: nothing has touched GPU 0):
# saves (blocking and overlapped staging) and a load of tensors on cuda:1 without set_device,
# then whether they were exact, the arena pinned, and GPU 0 given a context.
PIN_DEVICE_SCRIPT = """
import sys, torch
import bytecheckpoint as bcp
from bytecheckpoint.engine import staging
root = sys.argv[1]
dev = torch.device("cuda", 1)
torch.manual_seed(0)
state = {f"w{i}": torch.randn(1 << 18, device=dev) for i in range(4)}
want = {k: v.cpu() for k, v in state.items()}
from bytecheckpoint.state.tensor_shard import TensorShard
whole = {"model": {k: TensorShard(v, (1 << 18,)) for k, v in state.items()}}
bcp.save(root, whole, overwrite=True)
bcp.save(root, whole, async_save=True, overwrite=True).wait()
bcp.save(root, whole, async_save=True, snapshot="overlapped", overwrite=True).wait()
# half of each tensor: the boxes land in the load's pinned windows, then go to cuda:1
into = {k: torch.zeros(1 << 17, device=dev) for k in state}
bcp.load(root, {"model": {k: TensorShard(v, (1 << 18,), (1 << 17,)) for k, v in into.items()}})
exact = all(torch.equal(into[k].cpu(), want[k][1 << 17:]) for k in state)
pinned = staging.pool(True).is_pinned
print(f"exact={exact} pinned={pinned} context-on-0={torch._C._cuda_hasPrimaryContext(0)}")
"""


# -- overlapped snapshots on one GPU (issue 21) ----------------------------------------------


def overlapped_copy_ahead_of_later_work(root: str) -> dict[str, Any]:
    """An overlapped save, then ~2 s of GPU work queued on the caller's stream right after
    save() returns. The copy waits only for the work queued before save(), so the snapshot is
    done while that later work still runs; the bytes are those of the call."""
    device = torch.device("cuda", torch.cuda.current_device())
    state = _cuda_state(device, seed=4, mb=64)
    expected = {k: v.cpu().clone() for k, v in state.items()}
    handle = bcp.save(root, {"model": _as_module(state)}, async_save=True, snapshot="overlapped",
                      overwrite=True)
    torch.cuda._sleep(4_000_000_000)  # about 2 s of GPU time at H100 clocks
    snapshot_done = handle.wait_snapshot(timeout=120)
    later_work_running = not torch.cuda.current_stream().query()
    for v in state.values():
        v.fill_(7)  # allowed once wait_snapshot() returned
    handle.wait()
    torch.cuda.synchronize()
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(root, {"model": _as_module(into)})
    return {"snapshot_done": snapshot_done, "later_work_running": later_work_running,
            "exact": all(torch.equal(into[k].cpu(), expected[k]) for k in expected)}


def failed_save_leaves_no_copy_running(root: str, cap: int | None) -> dict[str, Any]:
    """A save whose writer fails (its target exists, found under the cached plan) while its D2H
    copies wait behind ~2 s of GPU work queued before save(). Once ``wait()`` has raised, no
    copy may still land in the pinned arena the next save reuses: a sentinel written there
    must survive ``torch.cuda.synchronize()``. (The bounded arena returned at once, copies
    queued, before its error path waited for its side stream.)"""
    device = torch.device("cuda", torch.cuda.current_device())
    module = _as_module(_cuda_state(device, seed=5, mb=64))
    opts: dict[str, Any] = {"async_save": True, "snapshot": "overlapped", "staging_max_bytes": cap}
    bcp.save(root, {"model": module}, **opts).wait()  # the plan is cached from here
    torch.cuda._sleep(4_000_000_000)  # about 2 s of GPU time: the next save's copies queue behind it
    handle = bcp.save(root, {"model": module}, **opts)  # a handle: the writer finds the target
    raised = None
    try:
        handle.wait(timeout=120)
    except bcp.CheckpointExistsError as exc:
        raised = type(exc).__name__
    arena_pool = staging.pool(True)
    arena = arena_pool.reserve(arena_pool.capacity)
    arena.fill_(0xA5)
    torch.cuda.synchronize()
    return {"raised": raised, "pinned": arena_pool.is_pinned, "arena_bytes": arena.numel(),
            "intact": bool((arena == 0xA5).all().item())}


def many_small_tensors_through_a_small_ring(root: str) -> dict[str, Any]:
    """600 small CUDA tensors of odd sizes and three dtypes through a 256 KiB bounded arena.
    Their copies are queued in groups with one event each, many groups per save, and the ring
    fills while a group is open (it is closed before the copier waits for ring memory).
    Bit-exact after training clobbers every tensor."""
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=device).manual_seed(11)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    state = {f"{i}": torch.randn(1 + (i * 7919) % 6000, device=device, generator=g).to(dtypes[i % 3])
             for i in range(600)}
    expected = {k: v.cpu() for k, v in state.items()}
    cap = 256 << 10
    handle = bcp.save(root, {"model": _as_module(state)}, async_save=True, snapshot="overlapped",
                      staging_max_bytes=cap)
    handle.wait_snapshot(timeout=120)  # buffers have no hook: the contract is wait_snapshot
    for v in state.values():
        v.fill_(3)  # the state moves on while the writers still drain the ring
    result = handle.wait(timeout=120)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(root, {"model": _as_module(into)})
    return {"staging_bytes": result.staging_bytes, "cap": cap,
            "differs": [k for k in expected if not torch.equal(into[k].cpu(), expected[k])]}


def _mlp_adam(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _backward(model: nn.Module, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(100 + k)
    model(torch.randn(32, 1024, device="cuda", generator=g)).square().mean().backward()


def overlapped_step_right_after_save(root: str, cap: int | None) -> dict[str, Any]:
    """Gradients are ready at save(); the optimizer steps on the very next line, and once more
    after another backward. The checkpoint must hold the state of the call, bit for bit, with
    the copy through the whole arena or in rounds through a bounded one (``cap`` bytes)."""
    from tests.support.helpers import same_bits

    model, optim = _mlp_adam(0)
    for k in range(2):
        _backward(model, k)
        optim.step()
        optim.zero_grad()
    _backward(model, 2)
    ref = w.full_state(model, optim)
    handle = bcp.save(root, {"model": model, "optimizer": optim}, async_save=True,
                      snapshot="overlapped", staging_max_bytes=cap, overwrite=True)
    optim.step()
    optim.zero_grad()
    _backward(model, 3)
    optim.step()
    result = handle.wait()
    tensors = [k for k, v in ref.items() if isinstance(v, torch.Tensor)]
    after = w.full_state(model, optim)
    moved = sum(not same_bits(ref[k], after[k]) for k in tensors)
    fresh, fresh_optim = _mlp_adam(9)
    _backward(fresh, 0)
    fresh_optim.step()  # optimizer state exists to load into
    bcp.load(root, {"model": fresh, "optimizer": fresh_optim})
    got = w.full_state(fresh, fresh_optim)
    assert sorted(got) == sorted(ref), set(got) ^ set(ref)
    return {"differs": [k for k in tensors if not same_bits(ref[k], got[k])],
            "compared": len(tensors), "moved_after_save": moved, "staging_bytes": result.staging_bytes}


# -- the CUDA targets' load path, on CPU ------------------------------------------------------


def fsdp2_save_for_windows(root: str) -> dict[str, Any]:
    from tests.support.workloads import fsdp2_train_save

    return fsdp2_train_save(root, steps=2)["ref"]


def fsdp2_load_through_windows(root: str) -> dict[str, Any]:
    """Load as a rank with CUDA targets does: every box into the window arena, then copied
    out (``devices.PRETEND_CUDA_TARGETS``)."""
    from tests.support.workloads import fsdp2_load

    devices.PRETEND_CUDA_TARGETS = True
    try:
        return fsdp2_load(f"{root}/step_2", with_extra=False)["state"]
    finally:
        devices.PRETEND_CUDA_TARGETS = False
