"""The GPU paths' logic, checked without a GPU (issue 22).

What needs a device runs in tests/distributed/test_gpu_paths.py; here: the load's transport agreed by
every rank (gloo ranks pretend CUDA through ``devices.PRETEND_CUDA``), failures inside the
load window and in the staging arena reaching every rank promptly, the sync save's staging
thread joined, the pinned pool's fallback, RNG restore with fewer devices, the groups the
D2H copies are queued in, and static checks that every thread the engine starts sets its
CUDA device before any CUDA call, that every side stream waits for other work before its
first copy, and that side streams are waited for when a copy fails.
"""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bytecheckpoint as bcp
from bytecheckpoint.engine import save as save_mod
from bytecheckpoint.engine import staging
from bytecheckpoint.engine.load_pipeline import BoxRead, Copy, LoadPipeline, copy_out, direct_target
from bytecheckpoint.engine.read_plan import ReadUnit
from bytecheckpoint.engine.transport import use_nccl
from bytecheckpoint.errors import PlanningError
from bytecheckpoint.format.boxes import Box
from bytecheckpoint.planners import LocalShard
from bytecheckpoint.state import extra
from tests.fuzz.strategies import fuzz_settings
from tests.support import gpu_workloads as g
from tests.support.helpers import same_bits

PACKAGE = Path(bcp.__file__).parent


# -- the transport: one choice for every rank ---------------------------------------------


def test_nccl_only_when_every_rank_can():
    assert use_nccl([True, True, True])
    assert not use_nccl([True, False, True])  # one rank with no CUDA target: all on gloo
    assert not use_nccl([])


@pytest.mark.parametrize("pretend", [[0, 1, 2], [0, 2], []])
def test_every_rank_takes_the_same_transport(world, tmp_path, pretend):
    pool = world(3)
    root = str(tmp_path / "ckpt")
    pool.run(g.save_replicated, root)
    results = pool.run(g.load_pretending, root, pretend)
    kinds = {r["transport"] for r in results}
    assert kinds == {"nccl" if len(pretend) == 3 else "gloo"}, results
    assert all(r["same"] for r in results), results  # every byte, Adam's CPU step included


def _target_box(n: int) -> tuple[BoxRead, LocalShard]:
    shard = LocalShard(Box((0,), (n,)), torch.zeros(n))  # a CPU target, like AdamW's step
    read = BoxRead("optimizer/state/w/step", "f", 0, 4 * n, 0, 4 * n, (), torch.float32,
                   Box((0,), (n,)), [Copy(Box((0,), (n,)), shard)])
    read.direct = direct_target(read)
    return read, shard


@pytest.mark.parametrize("reader,receivers", [(1, (0,)), (0, (1, 2))])
def test_batched_exchange_never_posts_host_tensors(reader, receivers):
    """NCCL takes device tensors only: a CPU target that is received or sent is staged
    through a buffer on the exchange device ("meta" stands in for CUDA here)."""
    read, shard = _target_box(4)
    unit = ReadUnit(0, 0, 16, 0, 16, reader, receivers)
    pipe = LoadPipeline(None, "", [unit], {unit.box: read}, rank=0, group=None,  # type: ignore[arg-type]
                        global_rank=lambda r: r, threads=1, verify=False, chunk_bytes=1 << 20,
                        device=torch.device("meta"), batched=True)
    pipe._allocate([unit], 0)
    assert pipe._slice(unit).device.type == "meta"  # what the receive or send would carry
    # over gloo the same box is still read straight into the target's own bytes
    read.buffer = None
    gloo = LoadPipeline(None, "", [unit], {unit.box: read}, rank=0, group=None,  # type: ignore[arg-type]
                        global_rank=lambda r: r, threads=1, verify=False, chunk_bytes=1 << 20,
                        device=torch.device("cpu"))
    gloo._allocate([unit], 0)
    assert read.buffer is not None and read.buffer.data_ptr() == shard.data.data_ptr()


# -- failures reach every rank, without waiting for a timeout -----------------------------


@pytest.mark.parametrize("pretend", [False, True])
def test_allocation_failure_in_the_load_window_fails_every_rank(world, tmp_path, pretend):
    pool = world(3)
    root = str(tmp_path / "ckpt")
    pool.run(g.save_replicated, root)
    results = pool.run(g.load_with_failed_allocation, root, 1, pretend)
    for r in results:
        assert r["raised"] is not None and r["raised"][1], results  # a CheckpointError
        assert r["elapsed"] < 30, results
    assert "out of memory" in results[1]["raised"][2]
    assert "rank 1" in results[0]["raised"][2] and "rank 1" in results[2]["raised"][2]
    # and the next load works
    assert all(r["same"] for r in pool.run(g.load_pretending, root, [0, 1, 2] if pretend else []))


def test_staging_arena_failure_on_one_rank_fails_every_rank(world, tmp_path):
    pool = world(2)
    results = pool.run(g.async_save_with_failed_arena, str(tmp_path / "ckpt"), 1)
    assert results[1]["raised"][0] == "StagingError", results
    assert results[0]["raised"][1] and "rank 1" in results[0]["raised"][2], results
    assert all(r["elapsed"] < 30 for r in results), results
    assert not (tmp_path / "ckpt").exists()


def test_pinned_pool_falls_back_to_plain_memory():
    """No CUDA here, so pinning fails for real: the pool warns and hands out plain memory."""
    pool = staging.HostBufferPool(pinned=True)
    with pytest.warns(RuntimeWarning, match="could not pin"):
        buf = pool.reserve(4096)
    buf.copy_(torch.arange(4096, dtype=torch.int64).remainder(256).to(torch.uint8))
    assert buf[300].item() == 300 % 256
    assert not pool.is_pinned and pool.pin_failures and pool.capacity == 4096


def test_gloo_twin_of_a_subgroup_is_made_by_its_members_alone(world):
    results = world(4).run(g.twin_of_subgroup, "nccl")
    assert results == [[0, 1], [0, 1], None, None]


# -- the synchronous save's staging thread ------------------------------------------------


def _slow_stager(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Stage on a thread even on CPU (the path device tensors take), 0.5 s late."""
    ended: list[float] = []
    original = staging.Stager.run

    def slow_run(self: staging.Stager) -> None:
        time.sleep(0.5)
        try:
            original(self)
        finally:
            ended.append(time.monotonic())

    monkeypatch.setattr(save_mod, "_needs_staging", lambda views: True)
    monkeypatch.setattr(staging.Stager, "run", slow_run)
    return ended


def test_sync_save_joins_its_staging_thread_when_the_write_fails(tmp_path, monkeypatch):
    ended = _slow_stager(monkeypatch)

    def failing_write(*args: object, **kwargs: object) -> None:
        raise OSError("the disk went away (injected)")

    monkeypatch.setattr(save_mod, "write_rank", failing_write)
    with pytest.raises(OSError, match="injected"):
        bcp.save(str(tmp_path / "c"), {"w": torch.arange(1000.0)})
    returned = time.monotonic()
    assert ended and ended[0] <= returned  # no copy was landing after save returned
    assert not [t for t in threading.enumerate() if t.name == "bcp-stage" and t.is_alive()]


def test_sync_save_through_the_staging_thread_is_exact(tmp_path, monkeypatch):
    _slow_stager(monkeypatch)
    state = {"w": torch.randn(64, 33), "b": torch.arange(7, dtype=torch.int16), "e": torch.empty(0)}
    bcp.save(str(tmp_path / "c"), state)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(str(tmp_path / "c"), into)
    assert all(torch.equal(state[k], into[k]) for k in state)
    assert not [t for t in threading.enumerate() if t.name == "bcp-stage" and t.is_alive()]


# -- RNG restore with fewer devices -------------------------------------------------------


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, devices: int, saved: int) -> list[int]:
    """A process that saw ``saved`` GPUs when saving and has ``devices`` now."""
    restored: list[int] = []

    def set_rng_state(state: torch.Tensor, device: int | str = "cuda") -> None:
        restored.append(int(device) if not isinstance(device, str) else -1)

    fake = [torch.get_rng_state() for _ in range(saved)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: fake)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_rng_state)  # set_rng_state_all's
    return restored


@pytest.mark.parametrize("devices,skipped,message", [
    (1, [1], r"skipped \[1\]"), (0, [0, 1], "no CUDA device"), (2, [], None)])
def test_rng_restore_skips_devices_this_process_lacks(tmp_path, monkeypatch, devices, skipped, message):
    restored = _fake_cuda(monkeypatch, devices=2, saved=2)
    bcp.save(str(tmp_path / "c"), {"rng": bcp.RNGState()})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
    rng = bcp.RNGState()
    if message is None:
        bcp.load(str(tmp_path / "c"), {"rng": rng})
    else:
        with pytest.warns(RuntimeWarning, match=message):
            bcp.load(str(tmp_path / "c"), {"rng": rng})
    assert restored == list(range(devices)) and rng.skipped_cuda_devices == skipped


def test_restore_rng_returns_what_it_skipped(monkeypatch):
    restored = _fake_cuda(monkeypatch, devices=1, saved=3)
    state = extra.capture_rng()
    assert len(state["cuda"]) == 3
    with pytest.warns(RuntimeWarning, match=r"restored devices 0..0, skipped \[1, 2\]"):
        assert extra.restore_rng(state) == [1, 2]
    assert restored == [0]


# -- static check: threads set their device before any CUDA call --------------------------

_GUARDS = {"on_device", "device"}  # devices.on_device(dev), torch.cuda.device(dev)
# No context and no current-device dependence: queries, and RNG calls that name the device.
_HARMLESS = {"is_available", "device_count", "is_initialized", "current_device", "get_rng_state_all",
             "set_rng_state"}
_CUDA_METHODS = {"record_stream", "wait_stream", "wait_event", "synchronize", "cuda"}
# Defs left out of the by-name resolution: they run on the user's own thread only, never as an
# engine thread's callee, and their names are common (a thread's ``f.close()`` is a file's).
# CheckpointManager.close() may save at close (a late preemption signal), on the caller's thread.
_USER_THREAD_ONLY = {("bytecheckpoint/manager/manager.py", "close")}


def _chain(node: ast.AST) -> list[str]:
    out: list[str] = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    elif isinstance(node, ast.Call):
        out += _chain(node.func)[::-1]  # x.cpu().copy_ -> x, cpu, copy_
    return out[::-1]


def _is_cuda_call(call: ast.Call) -> bool:
    chain = _chain(call.func)
    if "cuda" in chain[:-1] and chain[-1] not in _HARMLESS:
        return True  # torch.cuda.<anything that touches a device>
    if chain and chain[-1] in _CUDA_METHODS and len(chain) > 1:
        return True  # tensor.record_stream(...), event.synchronize(), t.cuda()
    return any(k.arg in ("non_blocking", "pin_memory") for k in call.keywords)


def _is_guard(item: ast.withitem) -> bool:
    expr = item.context_expr
    return isinstance(expr, ast.Call) and bool(_chain(expr.func)) and _chain(expr.func)[-1] in _GUARDS


class _Index:
    """Which functions of a package make a CUDA call outside any ``on_device`` /
    ``torch.cuda.device`` block, themselves or through a function they call. A call resolves
    by name to every def of that name in the package (an over-approximation: safe for a
    check that must not miss one)."""

    def __init__(self, modules: dict[str, ast.Module]) -> None:
        self.defs: dict[str, list[ast.AST]] = {}
        facts: dict[int, tuple[str | None, set[str]]] = {}
        for path, tree in modules.items():
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if (path, node.name) not in _USER_THREAD_ONLY:
                        self.defs.setdefault(node.name, []).append(node)
                    facts[id(node)] = _facts(node, path)
        # Fixpoint: a function is unguarded if it is itself, or calls one that is.
        self.why: dict[int, str] = {k: d for k, (d, _) in facts.items() if d}
        changed = True
        while changed:
            changed = False
            for key, (_, calls) in facts.items():
                if key in self.why:
                    continue
                for name in sorted(calls):
                    bad = next((self.why[id(d)] for d in self.defs.get(name, []) if id(d) in self.why), None)
                    if bad:
                        self.why[key] = f"{name}() -> {bad}"
                        changed = True
                        break

    def unguarded(self, fn: ast.AST, path: str) -> str | None:
        """Where ``fn`` reaches a CUDA call made before its device is set, or None."""
        direct, calls = _facts(fn, path)
        if direct:
            return direct
        for name in sorted(calls):
            bad = next((self.why[id(d)] for d in self.defs.get(name, []) if id(d) in self.why), None)
            if bad:
                return f"{path}: {name}() -> {bad}"
        return None


def _facts(fn: ast.AST, path: str) -> tuple[str | None, set[str]]:
    """A function's first unguarded CUDA call, and the names it calls outside guards."""
    direct: list[str] = []
    calls: set[str] = set()

    def scan(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return  # a nested function runs only when called (then it is resolved by name)
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(_is_guard(i) for i in node.items):
            return
        if isinstance(node, ast.Call):
            if _is_cuda_call(node):
                direct.append(f"{path}:{node.lineno}: {ast.unparse(node.func)}(...)")
            chain = _chain(node.func)
            if chain:
                calls.add(chain[-1])
        for child in ast.iter_child_nodes(node):
            scan(child)

    body = fn.body if isinstance(fn.body, list) else [fn.body]  # type: ignore[attr-defined]
    for stmt in body:
        scan(stmt)
    return (direct[0] if direct else None), calls


def _thread_targets(tree: ast.Module) -> list[tuple[ast.AST, int]]:
    """The callables a module hands to a thread: Thread(target=...), executor.submit/map,
    ThreadPoolExecutor(initializer=...). (Processes start fresh and are not threads.)"""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        chain = _chain(node.func)
        name = chain[-1] if chain else ""
        if name == "Thread":
            out += [(k.value, node.lineno) for k in node.keywords if k.arg == "target"]
        elif name == "ThreadPoolExecutor":
            out += [(k.value, node.lineno) for k in node.keywords if k.arg == "initializer"]
        elif name in ("submit", "map") and len(chain) > 1 and node.args:
            out.append((node.args[0], node.lineno))
    return out


def _resolve(target: ast.AST, tree: ast.Module) -> list[ast.AST]:
    if isinstance(target, ast.Lambda):
        return [target]
    chain = _chain(target)
    if not chain:
        return []
    return [n for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == chain[-1]]


def _violations(modules: dict[str, ast.Module]) -> tuple[list[str], int]:
    index = _Index(modules)
    problems, targets = [], 0
    for path, tree in modules.items():
        for target, line in _thread_targets(tree):
            for fn in _resolve(target, tree):
                targets += 1
                where = index.unguarded(fn, f"{path}:{line}")
                if where:
                    problems.append(where)
    return problems, targets


def _package_modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE.parent)): ast.parse(p.read_text())
            for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_engine_thread_sets_its_device_before_cuda_calls():
    problems, targets = _violations(_package_modules())
    assert targets >= 5, "the scan found too few thread targets: it is not looking"
    assert not problems, "threads making CUDA calls before on_device(...):\n" + "\n".join(problems)


def test_the_static_check_catches_a_thread_without_its_device():
    bad = ast.parse(
        "import threading, torch\n"
        "def copy_all(xs):\n"
        "    for x in xs:\n"
        "        x.cpu().copy_(x, non_blocking=True)\n"
        "def work(xs):\n"
        "    s = torch.cuda.Stream()\n"
        "    copy_all(xs)\n"
        "def start(xs):\n"
        "    threading.Thread(target=lambda: copy_all(xs)).start()\n"
        "    threading.Thread(target=work, args=(xs,)).start()\n"
        "def good(dev, xs):\n"
        "    with on_device(dev):\n"
        "        work(xs)\n"
        "def start_good(pool, dev, xs):\n"
        "    pool.submit(good, dev, xs)\n")
    problems, targets = _violations({"bad.py": bad})
    assert targets == 3 and len(problems) == 2, problems


def test_cuda_events_are_blocking():
    """A waiter on a plain CUDA event spins a core at 100% (the writer, a reader thread)."""
    spinning = []
    for path, tree in _package_modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _chain(node.func)[-2:] == ["cuda", "Event"]:
                blocking = [k for k in node.keywords if k.arg == "blocking"]
                if not (blocking and isinstance(blocking[0].value, ast.Constant) and blocking[0].value.value):
                    spinning.append(f"{path}:{node.lineno}")
    assert not spinning, f"torch.cuda.Event without blocking=True: {spinning}"


# -- static check: queued copies are waited for on every way out --------------------------

_STREAM_MAKERS = {"Stream", "_side_streams"}  # torch.cuda.Stream(...), Stager._side_streams()


def _makes_streams(chain: list[str]) -> bool:
    return bool(chain) and chain[-1] in _STREAM_MAKERS and (chain[-1] != "Stream" or "cuda" in chain)


def _functions(modules: dict[str, ast.Module]) -> list[tuple[str, ast.FunctionDef]]:
    return [(path, n) for path, tree in modules.items() for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef)]


def _synchronizers(modules: dict[str, ast.Module]) -> set[str]:
    """Names of the functions that call ``synchronize()`` or ``settle_streams()`` themselves
    (one level only: closing over every name they call would take in half the package)."""
    return {fn.name for _, fn in _functions(modules)
            if any(isinstance(n, ast.Call) and _chain(n.func)[-1:] in (["synchronize"], ["settle_streams"])
                   for n in ast.walk(fn))}


def _settles_on_failure(fn: ast.AST, synchronizers: set[str]) -> bool:
    """Whether ``fn`` synchronizes in a ``finally`` or in a handler of every exception."""
    for node in ast.walk(fn):
        if not isinstance(node, ast.Try):
            continue
        bodies = [h.body for h in node.handlers
                  if h.type is None or _chain(h.type)[-1:] == ["BaseException"]] + [node.finalbody]
        for stmt in (s for body in bodies for s in body):
            for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                name = (_chain(call.func) or [""])[-1]
                if name == "synchronize" or name in synchronizers:
                    return True
    return False


def _unsettled_streams(modules: dict[str, ast.Module]) -> tuple[list[str], int]:
    """Functions that make side streams and queue work on them, where neither they nor any
    function calling them waits for the streams when an error leaves: copies still queued
    would land in an arena (pinned, reused by the next save or load) or a freed buffer after
    the operation has failed and returned."""
    functions = _functions(modules)
    synchronizers = _synchronizers(modules)
    problems, makers = [], 0
    for path, fn in functions:
        if fn.name in _STREAM_MAKERS:
            continue
        made = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and _makes_streams(_chain(n.func))]
        if not made:
            continue
        makers += 1
        callers = [c for _, c in functions
                   if any(isinstance(n, ast.Call) and _chain(n.func)[-1:] == [fn.name] for n in ast.walk(c))]
        if not any(_settles_on_failure(f, synchronizers) for f in [fn, *callers]):
            problems.append(f"{path}:{made[0].lineno}: {fn.name}()")
    return problems, makers


def test_side_streams_are_waited_for_when_a_copy_fails():
    """A save or load that fails with D2H or H2D copies queued on its side streams must not
    return before they have run: the next one reuses the pinned arena they read or write."""
    problems, makers = _unsettled_streams(_package_modules())
    assert makers >= 3, "the scan found too few side streams: it is not looking"
    assert not problems, "side streams not synchronized on an error path:\n" + "\n".join(problems)


def test_the_static_check_catches_a_stream_left_running_on_failure():
    bad = ast.parse(
        "import torch\n"
        "def sync_all(sides):\n"
        "    for s in sides: s.synchronize()\n"
        "def copy(xs, out):\n"
        "    side = torch.cuda.Stream()\n"
        "    with torch.cuda.stream(side):\n"
        "        for x, o in zip(xs, out): o.copy_(x, non_blocking=True)\n"
        "    side.synchronize()  # the success path only\n"
        "def copy_caught(xs, out):\n"
        "    side = torch.cuda.Stream()\n"
        "    try:\n"
        "        out[0].copy_(xs[0], non_blocking=True)\n"
        "    except Exception:  # not every exception: a cancel passes through\n"
        "        side.synchronize()\n"
        "        raise\n"
        "def settled(xs, out):\n"
        "    side = torch.cuda.Stream()\n"
        "    try:\n"
        "        out[0].copy_(xs[0], non_blocking=True)\n"
        "    finally:\n"
        "        sync_all([side])\n"
        "def inner(self):\n"
        "    self.side = torch.cuda.Stream()\n"
        "def outer(self):\n"
        "    try:\n"
        "        inner(self)\n"
        "    except BaseException:\n"
        "        self.side.synchronize()\n"
        "        raise\n")
    problems, makers = _unsettled_streams({"bad.py": bad})
    assert makers == 4 and [p.split(" ")[1] for p in problems] == ["copy()", "copy_caught()"], problems


def _streams_never_waiting(modules: dict[str, ast.Module]) -> tuple[list[str], int]:
    """Streams the package makes (``X = torch.cuda.Stream(...)``) on which no call in the same
    module makes ``X`` wait for another stream or event. A new stream is ordered after nothing:
    work queued on it may overtake the caller's pending kernels on the same memory (the tensors
    being copied, or a buffer the caching allocator handed out on the caller's stream)."""
    problems, made = [], 0
    for path, tree in modules.items():
        waiting = {ast.unparse(n.func.value) for n in ast.walk(tree) if isinstance(n, ast.Call)
                   and isinstance(n.func, ast.Attribute) and n.func.attr in ("wait_stream", "wait_event")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and _chain(node.value.func)[-2:] == ["cuda", "Stream"]):
                made += 1
                for target in node.targets:
                    if ast.unparse(target) not in waiting:
                        problems.append(f"{path}:{node.lineno}: {ast.unparse(target)}")
    return problems, made


def test_every_side_stream_waits_before_its_first_copy():
    problems, made = _streams_never_waiting(_package_modules())
    assert made >= 2, "the scan found too few streams: it is not looking"
    assert not problems, "streams that never wait for the caller's work:\n" + "\n".join(problems)


def test_the_static_check_catches_a_stream_that_never_waits():
    bad = ast.parse(
        "import torch\n"
        "def good(dev, mark):\n"
        "    sides = {}\n"
        "    sides[dev] = torch.cuda.Stream(dev)\n"
        "    sides[dev].wait_event(mark)\n"
        "class Loader:\n"
        "    def start(self):\n"
        "        self.h2d = torch.cuda.Stream()\n"
        "        self.other = torch.cuda.Stream()\n"
        "    def window(self):\n"
        "        self.other.wait_stream(torch.cuda.current_stream())\n")
    problems, made = _streams_never_waiting({"bad.py": bad})
    assert made == 3 and problems == ["bad.py:8: self.h2d"], problems


@pytest.mark.parametrize("lo", [0, 20], ids=["whole-box", "from-row-1"])
@pytest.mark.parametrize("at", [0, 4096, 4160])
def test_copy_out_reads_a_box_buffer_that_is_a_slice_of_an_arena(at, lo):
    """Boxes bound for CUDA targets are read into slices of one pinned window arena; the copy
    into the target must start at the slice, not at the arena's first byte. (On a GPU every
    box after a window's first loaded the bytes before it: a weight came back shifted by its
    bias.) A CPU target takes the same copy here."""
    n = 6 * 5
    saved = torch.arange(n, dtype=torch.float32)
    held = saved.view(torch.uint8)[lo:]  # the buffer holds bytes [lo, end) of the box
    arena = torch.full((at + len(held) + 64,), 0xEE, dtype=torch.uint8)  # poison around it
    arena[at : at + len(held)] = held
    box = Box((0, 0), (6, 5))
    region = Box((1, 2), (4, 3))  # a resharded target: rows 1..4, columns 2..4
    shard = LocalShard(region, torch.zeros(4, 3))
    read = BoxRead("model/w", "f", 0, 4 * n, lo, 4 * n, (), torch.float32, box, [Copy(region, shard)])
    read.buffer = arena[at : at + len(held)]
    copy_out(read)
    assert torch.equal(shard.data, saved.view(6, 5)[1:5, 2:5])


@pytest.mark.parametrize("saved,loaded", [(2, 2), (2, 3)])
def test_loads_through_the_window_arena_are_exact(world, tmp_path, saved, loaded):
    """The path of CUDA targets (boxes read into slices of the window arena, then copied out),
    run on CPU through the test seam, same layout and resharded, compared bit for bit."""
    root = str(tmp_path / "c")
    ref = world(saved).run(g.fsdp2_save_for_windows, root)[0]
    for got in world(loaded).run(g.fsdp2_load_through_windows, root):
        tensors = [k for k, v in ref.items() if isinstance(v, torch.Tensor)]
        assert len(tensors) > 10 and all(same_bits(ref[k], got[k]) for k in tensors)


def test_copy_out_refuses_a_region_outside_its_buffer():
    """The arena around a box buffer holds other boxes: a region past the buffer must not be
    copied from them (torch checks bounds against the whole arena only)."""
    arena = torch.arange(64, dtype=torch.float32)
    box = Box((0,), (16,))
    shard = LocalShard(Box((0,), (16,)), torch.zeros(16))
    read = BoxRead("model/w", "f", 0, 64, 8 * 4, 64, (), torch.float32, box, [Copy(box, shard)])
    read.buffer = arena.view(torch.uint8)[64:96]  # holds elements 8..15 only
    with pytest.raises(PlanningError, match="copies elements 0..16 .* holding 8..16"):
        copy_out(read)
    assert torch.equal(shard.data, torch.zeros(16))


# -- D2H copies queued in groups, one event each -------------------------------------------


@given(st.lists(st.tuples(st.sampled_from([None, "cuda:0", "cuda:1"]), st.integers(0, 100)),
                max_size=40),
       st.integers(1, 250))
@fuzz_settings(200)
def test_copy_groups_cut_runs_of_one_device_as_soon_as_they_reach_the_limit(sources, limit):
    """Every source once, in order; a group is on one device and is cut at the first source
    that brings it to the limit, or where the device changes."""
    devices, sizes = [d for d, _ in sources], [n for _, n in sources]
    groups = list(staging.copy_groups(devices, sizes, limit))
    assert [i for _, run in groups for i in run] == list(range(len(sources)))
    for k, (dev, run) in enumerate(groups):
        assert run and all(devices[i] == dev for i in run)
        assert sum(sizes[i] for i in run[:-1]) < limit  # not cut later than the limit says
        if k + 1 < len(groups) and groups[k + 1][0] == dev:
            assert sum(sizes[i] for i in run) >= limit  # nor earlier
