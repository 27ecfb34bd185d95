"""The save workflow, run by every rank.

  1. collect         flatten the state, ask the planner for this rank's boxes (local plan)
  2. plan            hash the structure; cache hit: reuse the assignment (no communication,
                     no planning work). Otherwise gather
                     local plans; the coordinator dedups, balances, validates, and scatters
                     each rank's assignment and the staging directory
  3. stage           async saves and device tensors: copy the assigned boxes into the host
                     arena (``staging``); a synchronous save of CPU tensors writes in place
  4. write           every rank writes its storage files (checksums computed as it writes);
                     with files_per="host", each host's first rank writes one file per kind
                     from the bytes its other ranks stream to it (``host_files``)
  5. commit          coordinator: metadata last, rename into place, move ``latest``
Steps 4-5 run on a background thread for ``async_save=True``; ``save`` returns after 3.
Every collective carries values or errors, so every rank returns the same result or raises,
and all of them run on a gloo group reserved for saves (``comm._save_group``).

The first collective of a save is always a gather to the coordinator: a local plan from a
rank that must plan, or "written under cached plan P, save n" from one whose plan cache hit
(see ``plan_cache``). The coordinator's answer decides what every rank does next: write its
assignment, done (committed), or plan again.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from telemetry import set_context, span

from .. import errors
from ..commit import save_lock
from ..commit.integrity import (
    abandon,
    begin_save,
    commit,
    split_checkpoint_path,
    staging_path,
    update_latest,
)
from ..commit.protocol import check_save_settings, data_file_tag, prepare_target
from ..errors import (
    CheckpointExistsError,
    InvalidArgumentError,
    PlanningError,
    RankFailedError,
    StagingError,
    StorageError,
)
from ..format import codec
from ..format.boxes import Box
from ..format.dtypes import dtype_name
from ..format.metadata import METADATA_FILE
from ..planners import LocalShard, get_planner
from ..planning import plan_cache
from ..planning.global_plan import (
    GlobalSavePlan,
    LocalSavePlan,
    WriteItem,
    check_replicas,
    check_shared_objects,
    plan_save,
)
from ..planning.plan_cache import CacheEntry, rows_digest, structure_key
from ..planning.save_metadata import RankWrite, build_metadata, metadata_template
from ..runtime import gc_pause
from ..runtime.comm import Communicator, Outcome, summarize_failures
from ..runtime.devices import on_device
from ..runtime.gc_pause import gc_paused
from ..runtime.identity import stamp_rank, stamp_topology, state_tensors
from ..state.flatten import FlatState, flatten_state
from ..storage import CommitMode, Storage, open_storage, write_slots
from . import host_files, pieces_memo, replicas, snapshot, staging, staging_ring, write_through
from .async_save import SaveHandle, launch_pending, save_turn, set_pending, wait_pending
from .host_files import HostLayout
from .messages import (
    Assign,
    Assignment,
    CacheHit,
    Committed,
    PlanRequest,
    Replan,
    SaveOptions,
    Totals,
    UseCache,
    Written,
)
from .snapshot import Snapshot, SnapshotMode
from .staging import Stager
from .staging_ring import CappedStager
from .write_through import WriteThroughStager
from .writer import KIND_ORDER, Entry, TensorSource, rank_entries, write_rank


@dataclass
class SaveResult:
    """What a save did, the same on every rank except the per-rank byte count."""

    path: str
    step: int | None
    framework: str
    bytes_written: int  # by this rank
    total_bytes: int  # all storage files of the checkpoint
    metadata_bytes: int
    files: int
    duration_s: float
    phases: dict[str, float] = field(default_factory=dict)  # seconds on this rank
    cached_plan: bool = False  # the plan cache served this save (no planning messages)
    staging_bytes: int = 0  # peak host arena bytes this rank staged into (0: wrote in place)


@dataclass
class _Job:
    """One save on this rank: settings, what was collected, and what the plan decided."""

    url: str
    storage: Storage
    path: str
    comm: Communicator
    opts: SaveOptions
    t0: float
    host: HostLayout | None = None  # files_per="host": this rank's host
    phases: dict[str, float] = field(default_factory=dict)
    flat: FlatState | None = None
    framework: str = ""
    layout: dict[str, Any] = field(default_factory=dict)
    shards: dict[str, list[LocalShard]] = field(default_factory=dict)
    local: LocalSavePlan | None = None
    blobs: dict[str, bytes] = field(default_factory=dict)
    key: str = ""
    boxes_digest: bytes = b""
    global_plan: GlobalSavePlan | None = None  # coordinator, after planning
    locators: list[Any] | None = None  # where each assigned item lies in the shards (_locate)
    rows: list[Any] | None = None  # the local plan's items as tuples, until _local_plan makes them
    lock: save_lock.SaveLock | None = None  # coordinator: held from begin_save to the commit's end
    snapshot: Snapshot | None = None  # an overlapped save's copy, settled before the commit
    modules: list[torch.nn.Module] = field(default_factory=list)  # the state's top-level modules
    cached: Assignment | None = None  # coordinator: the cached round it is writing (its staging)
    # Samples of the replicated boxes taken at save() time (or the error taking them).
    replicas: replicas.Samples | BaseException | None = None
    call_id: str | None = None  # telemetry: the "save" span's call, continued in the background

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


Locator = tuple[int, "tuple[slice, ...] | None"]  # a held shard's index, the slices of it (None: all)


def _locate(item: WriteItem, shards: list[LocalShard]) -> Locator:
    """Where in this rank's shards of ``item.key`` the box ``item.box`` lies. A function of
    the shards' boxes alone, which the plan cache's structure key covers, so a cache hit
    reuses it."""
    for i, shard in enumerate(shards):
        if shard.box == item.box:
            return i, None
        if shard.box.intersect(item.box) == item.box:
            return i, item.box.relative_to(shard.box).slices()
    raise RuntimeError(f"{item.key}: this rank holds no box containing {item.box}")


def _take_replica_samples(job: _Job, assignment: Assignment) -> None:
    """Sample this rank's replicated boxes now, while they hold the values of this save()
    call (digested in the write); a failure is raised inside this rank's write, so it reaches
    every rank."""
    try:
        views = [s.data if s is not None else None  # rows' data (None: the row of an empty share)
                 for shards in job.shards.values() for s in shards or [None]]
        job.replicas = replicas.take_samples(views, assignment.replicas)
    except Exception as exc:
        job.replicas = exc


def _check_replicas(keys: list[tuple[str, ...]], digests: list[dict[int, tuple[int, ...]]]) -> None:
    """Refuse replicas that differ, or only log them where ``BCP_DIFFERING_REPLICAS=warn``
    (BatchNorm statistics under DDP differ per rank by design; the save keeps one copy)."""
    try:
        check_replicas(keys, digests)
    except PlanningError as exc:
        if replicas.mode() != "warn":
            raise
        warnings.warn(f"saving one copy of replicas that differ ({replicas.MODE_ENV}=warn): {exc}",
                      RuntimeWarning, stacklevel=2)


def _source_views(job: _Job, items: list[WriteItem], locators: list[Locator] | None) -> list[torch.Tensor]:
    """The views of this rank's live data that hold ``items``; ``job.locators`` keeps where."""
    if locators is None or len(locators) != len(items):
        locators = [_locate(item, job.shards[item.key]) for item in items]
    job.locators = locators
    views = []
    for item, (i, sl) in zip(items, locators):
        data = job.shards[item.key][i].data
        views.append(data if sl is None else data[sl])
    return views


def _nothing_of(shape: tuple[int, ...]) -> Box:
    """The empty box a rank that holds none of a tensor offers (planning skips it). A 0-d
    tensor has no empty box of its own rank (``Box((), ())`` is its one element, and offering
    it made a rank that held nothing its writer), so it gets a 1-d one."""
    n = max(1, len(shape))
    return Box((0,) * n, (0,) * n)


def _collect(job: _Job, state: Any, framework: str | None, fqn_map: Callable[[str], str] | None) -> None:
    comm = job.comm
    flat = flatten_state(state, fqn_map=fqn_map)
    stamp_topology(flat.tensors.values())
    planner = get_planner(framework, flat, comm)
    memo = pieces_memo.lookup(planner.name, comm.global_ranks, flat.tensors)
    if memo is not None:  # the same tensors as the last save: the same pieces
        job.shards, rows, digest = memo.shards(flat.tensors), memo.rows, memo.digest
    else:
        rows = []  # the local plan's items, as tuples
        for key, tensor in flat.tensors.items():
            local = planner.pieces(key, tensor)
            job.shards[key] = local
            dtype = dtype_name(tensor.dtype)
            shape = planner.global_shape(tensor)
            rows.extend((key, dtype, shape, s.box) for s in local)
            if not local:  # a rank may hold nothing of a tensor; still announce its shape
                rows.append((key, dtype, shape, _nothing_of(shape)))
        digest = rows_digest(rows)
        pieces_memo.remember(planner.name, comm.global_ranks, flat.tensors, job.shards, rows, digest)
    # An optimizer's hyperparameters are one dict per group, shared by all of its parameters'
    # entries: each object is encoded and hashed once (nothing changes it during the call).
    packed: dict[int, tuple[bytes, tuple[int, int]]] = {}
    blobs, shared = {}, {}
    for k, v in flat.shared_objects.items():
        if id(v) not in packed:
            b = codec.encode(v)
            packed[id(v)] = (b, (len(b), xxhash.xxh3_64_intdigest(b)))
        blobs[f"shared:{k}"], shared[k] = packed[id(v)]
    blobs.update({f"rank:{k}": codec.encode(v) for k, v in flat.rank_objects.items()})
    _warn_big_objects(blobs)
    own_bytes = sum(len(b) for k, b in blobs.items() if k.startswith("rank:"))
    job.flat, job.framework, job.blobs = flat, planner.name, blobs
    job.modules = snapshot.saved_modules(state)
    job.layout = planner.layout(flat, comm)
    # The items themselves are made only if the plan cache misses (_local_plan).
    job.local = LocalSavePlan(comm.rank, [], own_bytes, shared)
    job.rows = rows
    job.boxes_digest = digest


BIG_OBJECT_BYTES = 64 << 20
_WARNED_BIG: set[str] = set()


def _warn_big_objects(blobs: dict[str, bytes]) -> None:
    """A large per-rank object is nearly always a state dict of tensors passed instead of its
    module (``{"model": model.state_dict()}``): it still saves and loads, but as one packed
    blob per rank, so replicas are not deduplicated and nothing reshards. Said once per key."""
    for name, blob in blobs.items():
        key = name.removeprefix("rank:")
        if name.startswith("rank:") and len(blob) >= BIG_OBJECT_BYTES and key not in _WARNED_BIG:
            _WARNED_BIG.add(key)
            warnings.warn(
                f"state[{key!r}] is saved per rank as one packed object of {len(blob) >> 20} MiB "
                "(a plain value, not a module or optimizer): every rank writes its own copy and "
                "it cannot be resharded. Pass modules and optimizers themselves, e.g. "
                "{'model': model, 'optimizer': optim}, to store their tensors one by one",
                RuntimeWarning, stacklevel=4)


def _local_plan(job: _Job) -> LocalSavePlan:
    assert job.local is not None
    if job.rows is not None:
        job.local = dataclasses.replace(job.local, items=[WriteItem(*r) for r in job.rows])
        job.rows = None
    return job.local


# -- the coordinator's side of the first round -----------------------------------------------


def _coordinator_failure(exc: BaseException) -> Outcome:
    err = Outcome.failure(exc)
    return Outcome(value={0: err.error}, error=str(exc), error_type=type(exc).__name__)


def _plan_globally(job: _Job, plans: list[LocalSavePlan]) -> list[Outcome]:
    job.global_plan = plan_save(plans)
    save_id = uuid.uuid4().hex[:12]
    # The path's save lock, held until the commit ends: no other save touches it meanwhile.
    lock = save_lock.acquire(job.storage, job.path, save_id)
    try:
        # Checks the target, clears crashed saves' leftovers, and (on object stores) writes the
        # owner record that keeps a half-written checkpoint from ever looking committed.
        staging = begin_save(job.storage, job.path, job.opts.overwrite, save_id, lock=lock)
    except BaseException:
        lock.release()
        raise
    job.lock = lock
    rank_bytes = [p.object_bytes + sum(i.nbytes for i in items)
                  for p, items in zip(plans, job.global_plan.assignments)]
    shares = host_files.write_shares(job.opts.files_per, job.opts.host_size, rank_bytes)
    plan = job.global_plan
    return [Outcome(value=Assign(Assignment(staging, save_id, items, shared, save_id, share, held)))
            for items, shared, share, held in zip(plan.assignments, plan.shared_assignments, shares,
                                                  plan.replica_rows)]


def _commit(job: _Job, staging: str, save_id: str, writes: list[RankWrite], template: Any) -> Totals:
    meta = build_metadata(
        template, writes, framework=job.framework, world_size=job.comm.world_size, layout=job.layout,
        step=job.opts.step, user_metadata=job.opts.user_metadata, chunk_bytes=job.opts.chunk_bytes,
    )
    raw = meta.to_bytes()
    storage = job.storage
    storage.write_bytes(storage.join(staging, METADATA_FILE), raw)
    commit(storage, staging, job.path, job.opts.overwrite, save_id)
    try:
        update_latest(storage, job.path, job.opts.step, save_id)
    except Exception as exc:  # committed all the same: never undone because of the pointer
        raise StorageError(
            f"{storage.url(job.path)} was committed, but the latest pointer next to it could not "
            f"be moved to it ({type(exc).__name__}: {exc}); load it by its path, or save again"
        ) from exc
    return Totals(meta.total_bytes, len(raw), len(meta.files))


def _decide(job: _Job, gathered: list[Outcome]) -> list[Outcome]:
    """The coordinator's answer to the first round, one outcome per rank."""
    planning = all(o.error is None and isinstance(o.value, PlanRequest) for o in gathered)
    try:
        return _answer(job, gathered)
    finally:
        if not planning:  # a cached-plan save ends here (committed, failed or replanned)
            job.release()


def _answer(job: _Job, gathered: list[Outcome]) -> list[Outcome]:
    world = job.comm.world_size
    written: list[Written] = [o.value for o in gathered if o.error is None and isinstance(o.value, Written)]
    try:
        failed = summarize_failures(gathered)
        if failed is not None:
            for w in written:  # quietly: the ranks' failure is the error to report
                abandon(job.storage, w.staging, job.path, w.save_id)
            if job.cached is not None and job.lock is not None and not written:
                # Every rank failed under a cached plan: their shared staging directory holds
                # what they wrote before failing (a full disk: up to a whole checkpoint).
                abandon(job.storage, job.cached.staging, job.path, job.cached.save_id)
            return [failed] * world
        requests: list[PlanRequest | Written | CacheHit] = [o.value for o in gathered]
        _check_same_call(requests)
        if all(isinstance(r, PlanRequest) for r in requests):
            return _plan_globally(job, [r.local for r in requests])
        entry = plan_cache.get(job.comm.global_ranks)
        claims = {(r.plan_id, r.save_id) for r in requests if isinstance(r, CacheHit)}
        if claims and len(claims) == 1 and all(isinstance(r, CacheHit) for r in requests) \
                and entry is not None and claims == {(entry.plan_id, entry.save_id())}:
            return [Outcome(value=UseCache())] * world
        ids = {(w.plan_id, w.save_id) for w in written}
        if len(written) == world and entry is not None and ids == {(entry.plan_id, entry.save_id())}:
            check_shared_objects([w.shared for w in written])
            assert entry.plan is not None
            _check_replicas(entry.plan.replica_keys, [w.write.replicas for w in written])
            totals = _commit(job, written[0].staging, entry.save_id(), [w.write for w in written],
                             entry.template)
            return [Outcome(value=Committed(totals))] * world
        # Some ranks' caches hit and others' did not: the structure changed on some ranks.
        for w in written:
            abandon(job.storage, w.staging, job.path, w.save_id)
        if written and any(r.async_save for r in requests):  # staged copies follow the old plan
            raise PlanningError(
                "the state structure changed on some ranks but not on others since the last "
                "save, so the cached save plan no longer fits and this async save was not "
                "committed; save again (the next save plans from scratch)"
            )
        return [Outcome(value=Replan())] * world
    except Exception as exc:
        for w in written:
            abandon(job.storage, w.staging, job.path, w.save_id)
        return [_coordinator_failure(exc)] * world


def _raise_if_failed(outcome: Outcome, local_error: BaseException | None, what: str) -> None:
    """Raise this rank's own error, else the coordinator's (same type), else a summary."""
    if outcome.error is None:
        return
    if local_error is not None:
        raise local_error
    cls = getattr(errors, outcome.error_type or "", None)
    simple = (errors.CheckpointError, errors.MissingKeysError, errors.RankFailedError)
    if isinstance(cls, type) and issubclass(cls, errors.CheckpointError) and not issubclass(
        cls, simple[1:]
    ):
        try:
            same = cls(outcome.error)
        except TypeError:  # a class whose constructor wants more than a message: summarised
            same = None
        if same is not None:
            raise same
    failures = outcome.value if isinstance(outcome.value, dict) else {-1: outcome.error}
    raise RankFailedError(f"{what} {outcome.error}", failures)


def _first_round(job: _Job, mine: Outcome, local_error: BaseException | None) -> Assign | Committed | Replan:
    comm = job.comm
    gathered = comm.gather(mine)
    per_rank = _decide(job, gathered) if comm.is_coordinator else None
    received = comm.scatter(per_rank)
    _raise_if_failed(received, local_error, "checkpoint save")
    return received.value


def _plan_outcome(job: _Job) -> Outcome:
    return Outcome(value=PlanRequest(_local_plan(job), job.opts.async_save, _call_of(job)))


def _call_of(job: _Job) -> tuple[tuple[str, Any], ...]:
    """The arguments of this rank's ``save()`` that every rank must pass alike. The file
    layout is compared as resolved (argument or environment), as the ranks will act on it."""
    o, host = job.opts, job.host
    return (("path", job.storage.url(job.path)), ("step", o.step), ("overwrite", o.overwrite),
            ("chunk_bytes", o.chunk_bytes), ("async_save", o.async_save), ("snapshot", o.snapshot),
            ("files_per", "rank" if host is None else "host"),
            ("host_size", None if host is None else host.size), ("framework", o.framework))


def _agree_on_hit(job: _Job, entry: CacheEntry) -> bool:
    """files_per="host": a host's ranks stream to its leader as they write, so none may write
    under a cached plan before every rank of the world is known to have hit it, with the
    same arguments (a rank saving one file per rank would never join the host's streams).
    One round with the coordinator, in place of the planning round; True: write."""
    hit = CacheHit(entry.plan_id, entry.save_id(), job.opts.async_save, _call_of(job))
    return isinstance(_first_round(job, Outcome(value=hit), None), UseCache)


def _check_same_call(requests: list[Any]) -> None:
    """Ranks that called one save with different arguments (a per-rank timestamp in the path,
    say) each got success while only the coordinator's path was committed, under its step."""
    calls = [getattr(r, "call", ()) for r in requests]
    for rank, call in enumerate(calls):
        if call != calls[0]:
            name, mine = next((a, b) for a, b in zip(calls[0], call) if a != b)
            raise InvalidArgumentError(
                f"the ranks called save() with different arguments: {name[0]} {name[1]!r} on rank 0, "
                f"{mine[1]!r} on rank {rank}; every rank of the group must pass the same {name[0]} "
                "(nothing was committed)")


def _plan(job: _Job, local_error: BaseException | None) -> Assignment:
    """Plan without the cache (every rank does, in the same round)."""
    mine = Outcome.failure(local_error) if local_error is not None else _plan_outcome(job)
    decision = _first_round(job, mine, local_error)
    while isinstance(decision, Replan):
        decision = _first_round(job, _plan_outcome(job), None)
    if not isinstance(decision, Assign):
        raise PlanningError(f"the coordinator answered a plan request with {type(decision).__name__}")
    return decision.assignment


# -- writing and committing ----------------------------------------------------------------


def _needs_staging(views: list[torch.Tensor]) -> bool:
    """Device tensors are copied into host memory even by a synchronous save (a writer
    cannot read device memory); host tensors are written in place."""
    return any(v.is_cuda for v in views)


class _Sources:
    """The bytes of a rank's assigned boxes: staged copies, or live tensor views.

    Allocating the staging arena can fail on one rank (no host memory), and so can finding a
    box's bytes. The error is kept and raised inside this rank's write, so it reaches every
    rank through the next collective instead of leaving the others waiting in it."""

    def __init__(self, job: _Job, assignment: Assignment, stage: bool,
                 locators: list[Locator] | None = None) -> None:
        self.stager: Stager | None = None
        self.error: Exception | None = None
        self.thread: threading.Thread | None = None
        self.fns: list[Callable[[], memoryview]] = []
        try:
            views = _source_views(job, assignment.items, locators)
        except Exception as exc:  # kept the same way: raised here, the other ranks waited for ever
            self.error = exc
            return
        try:
            if stage or _needs_staging(views):
                self.stager = _stager(job, assignment, views)
        except StagingError as exc:
            self.error = exc
        except InvalidArgumentError as exc:
            self.error = StagingError(str(exc))
            self.error.__cause__ = exc
        except Exception as exc:
            self.error = StagingError(f"could not allocate host memory to stage this save's "
                                      f"{len(views)} tensor piece(s): {exc}; free host memory, "
                                      f"bound it with {staging_ring.SETTING}, or save synchronously")
            self.error.__cause__ = exc
        if self.stager is not None:
            self.fns = self.stager.sources_for_writer
        else:
            self.fns = [TensorSource(v) for v in views]

    @property
    def capped(self) -> bool:
        """The copy runs in rounds through a bounded arena: the writer must run alongside."""
        return isinstance(self.stager, CappedStager)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def stage_in_background(self, on_queued: Callable[[Any], None] | None = None,
                            on_done: Callable[[], None] | None = None) -> None:
        """Copy while the writer writes what has landed (synchronous saves of device tensors,
        and bounded arenas); ``on_done`` runs once no copy is left."""
        if self.stager is None:
            if on_done is not None:
                on_done()
            return
        stager, device = self.stager, self.stager.device

        def run() -> None:
            with on_device(device):  # the caller's device: a new thread starts on cuda:0
                try:
                    stager.run(on_queued) if on_queued is not None else stager.run()
                except BaseException:  # kept in stager.error; the pieces raise it to the writer
                    pass
                finally:
                    if on_done is not None:
                        on_done()

        self.thread = threading.Thread(target=run, name="bcp-stage", daemon=True)
        self.thread.start()

    def join(self) -> None:
        """Wait for the staging thread, stopping it first if copies remain (the writer has
        taken every piece it wanted by now). No copy is landing in the arena afterwards."""
        if self.thread is not None:
            assert self.stager is not None
            self.stager.cancel()
            self.thread.join()
            self.thread = None


def _detached(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """An overlapped save reads its sources after save() has returned. A source that is the
    state's own tensor follows a ``.data =`` swap (``model.to(torch.float16)`` does one on a
    frozen parameter): it would be read with the new bytes, size or dtype. A detached alias
    keeps the storage of save() time and shares the version counter the checks read."""
    return [v.detach() for v in views]


def _stager(job: _Job, assignment: Assignment, views: list[torch.Tensor]) -> Stager:
    """The stager of this save: the whole share in one arena, or rounds through a bounded one."""
    flat = job.flat.tensors if job.flat is not None else {}
    owners = [flat.get(item.key) for item in assignment.items]  # a tensor, or a TensorShard
    owners = [o if isinstance(o, torch.Tensor) else v for o, v in zip(owners, views)]
    names = [item.key for item in assignment.items]
    if job.opts.async_save and job.opts.snapshot == SnapshotMode.OVERLAPPED:
        views = _detached(views)
        # Only here: finding a buffer walks every submodule of a model that has none.
        forward_waits = any(snapshot.waits_in_forward(m) for m in job.modules)
        if write_through.applies(views, job.storage, forward_waits, job.host is not None):
            return WriteThroughStager(views, names, owners)
    cap = staging_ring.staging_cap(job.opts.staging_max_bytes)
    need = sum(-(-v.numel() * v.element_size() // 64) * 64 for v in views)
    if cap is None or need <= cap:
        if cap is not None:
            staging.pool(any(v.is_cuda for v in views)).bound(cap)
        return Stager(views, names, owners)
    if job.host is not None:
        raise StagingError(f"{staging_ring.SETTING} / staging_max_bytes bounds the staging arena of "
                           "files_per='rank' saves only (a host member streams whole pieces to its "
                           "leader); unset it or save with files_per='rank'")
    # Copy in the order the writers take pieces: kind by kind, plan order within a kind.
    kinds = [KIND_ORDER.index(job.flat.kind_of(item.key)) if job.flat is not None else 0
             for item in assignment.items]
    order = sorted(range(len(views)), key=kinds.__getitem__)
    return CappedStager(views, names, owners, cap, job.opts.chunk_bytes, order)


def _prepare(job: _Job, assignment: Assignment) -> None:
    """A cached plan: no coordinator created the staging directory this time. The coordinator
    takes the path's save lock and checks the target as ``begin_save`` would."""
    storage = job.storage
    if job.comm.is_coordinator:
        job.lock = save_lock.acquire(storage, job.path, assignment.save_id)
        prepare_target(storage, job.path, job.opts.overwrite, job.lock)
    elif storage.exists(job.path) and not job.opts.overwrite:
        raise CheckpointExistsError(
            f"{storage.url(job.path)} already holds a checkpoint; choose a new path or "
            "pass overwrite=True"
        )
    storage.makedirs(assignment.staging)


def _objects(job: _Job, assignment: Assignment) -> dict[str, bytes]:
    mine = {f"shared:{k}" for k in assignment.shared_keys}
    return {n: b for n, b in job.blobs.items() if n.startswith("rank:") or n in mine}


def _write(job: _Job, assignment: Assignment, sources: _Sources, makedirs: bool
           ) -> tuple[RankWrite | None, BaseException | None]:
    t = time.perf_counter()
    try:
        if isinstance(job.replicas, BaseException):
            raise job.replicas
        digests = replicas.replica_digests(job.replicas)
        if job.host is not None:
            written = _write_host(job, job.host, assignment, sources, makedirs)
        else:
            sources.check()
            if makedirs:
                _prepare(job, assignment)
            assert job.flat is not None
            written = write_rank(job.storage, assignment.staging, assignment.items, sources.fns,
                                 job.flat, _objects(job, assignment), job.comm.rank,
                                 job.opts.chunk_bytes,
                                 file_tag=data_file_tag(job.storage, job.opts.overwrite, assignment.save_id))
        if isinstance(sources.stager, WriteThroughStager):
            sources.stager.finish()  # every piece has gone through write(): the snapshot is taken
        if job.snapshot is not None:  # an in-place write racing the copy fails the save here
            with span("save.confirm"):
                job.snapshot.settle()
        return dataclasses.replace(written, replicas=digests), None
    except BaseException as exc:  # a KeyboardInterrupt too: raised after the commit round
        if sources.stager is not None:  # a bounded arena's copy would wait for this writer
            sources.stager.cancel()
        return None, exc
    finally:
        job.phases["write"] = job.phases.get("write", 0.0) + time.perf_counter() - t


def _write_host(job: _Job, host: HostLayout, assignment: Assignment, sources: _Sources,
                makedirs: bool) -> RankWrite:
    """files_per="host": a failure before the exchange still goes to the host's exchange, so
    the leader and the members always meet (see ``host_files``)."""
    leader = job.comm.rank == host.leader
    pairs: list[tuple[Entry, Callable[[], memoryview]]] = []
    error: BaseException | None = None
    try:
        sources.check()
        if makedirs and leader:  # members create nothing: they write no files
            _prepare(job, assignment)
        assert job.flat is not None
        pairs = rank_entries(assignment.items, sources.fns, job.flat, _objects(job, assignment),
                             job.comm.rank, tag_rank_objects=True)
    except BaseException as exc:  # a KeyboardInterrupt too: the leader waits for the manifest
        error = exc
    tag = data_file_tag(job.storage, job.opts.overwrite, assignment.save_id)
    return host_files.write_host(job.comm, host, job.storage, assignment.staging, pairs, error,
                                 job.opts.chunk_bytes, tag)


def _commit_round(job: _Job, assignment: Assignment, written: RankWrite | None,
                  local_error: BaseException | None) -> Totals:
    comm = job.comm
    t = time.perf_counter()
    mine = Outcome.failure(local_error) if local_error is not None else Outcome(value=written)
    gathered = comm.gather(mine)
    with span("save.commit"):
        result: Outcome | None = None
        template = None
        if comm.is_coordinator:
            assert gathered is not None and job.global_plan is not None
            result = summarize_failures(gathered)
            if result is None:
                try:
                    writes = [o.value for o in gathered]
                    _check_replicas(job.global_plan.replica_keys, [w.replicas for w in writes])
                    template = metadata_template(job.global_plan, writes)
                    result = Outcome(value=_commit(job, assignment.staging, assignment.save_id, writes,
                                                   template))
                except Exception as exc:
                    local_error, result = exc, _coordinator_failure(exc)
            try:
                if result.error is not None:
                    abandon(job.storage, assignment.staging, job.path, assignment.save_id)
            finally:
                job.release()
        final = comm.broadcast(result)
    job.phases["commit"] = time.perf_counter() - t
    _raise_if_failed(final, local_error, "checkpoint save")
    assert job.local is not None
    plan_cache.put(comm.global_ranks, CacheEntry(
        job.key, assignment.plan_id, 0, assignment.items, assignment.shared_keys,
        job.global_plan, template, job.locators, assignment.write_share, assignment.replicas))
    return final.value


def _finish(job: _Job, assignment: Assignment, hit: bool, sources: _Sources) -> SaveResult:
    """Steps 4-5 (on the background thread for an async save)."""
    comm = job.comm
    try:
        name = "save.background" if job.opts.async_save else "save.finish"
        # Its own checkpoint scope: an async save's "save" span has ended by now, and the
        # writes and commit (on this and the writers' threads) belong to this save and step.
        with span(name, path=job.url, step=job.opts.step, checkpoint_op="save", call_id=job.call_id):
            while True:
                written, error = _write(job, assignment, sources, makedirs=hit)
                if not hit:
                    totals = _commit_round(job, assignment, written, error)
                    break
                t = time.perf_counter()
                job.cached = assignment
                mine = Outcome.failure(error) if error is not None else Outcome(value=Written(
                    assignment.plan_id, assignment.save_id, assignment.staging, written,
                    job.local.shared if job.local else {}, job.opts.async_save, _call_of(job)))
                with span("save.commit", cached=True):
                    decision = _first_round(job, mine, error)
                job.phases["commit"] = time.perf_counter() - t
                if isinstance(decision, Committed):
                    entry = plan_cache.get(comm.global_ranks)
                    assert entry is not None
                    entry.seq += 1
                    totals = decision.totals
                    break
                # "replan" (synchronous saves only): the tensors have not changed meanwhile.
                hit = False
                sources.join()  # the old copies are done before the arena is reused
                assignment = _plan(job, None)
                _take_replica_samples(job, assignment)
                sources = _Sources(job, assignment, stage=False)
                sources.stage_in_background()
    except BaseException:
        plan_cache.drop(comm.global_ranks)
        raise
    finally:
        sources.join()  # a sync save returns only when no copy is landing in the arena
        job.release()  # whatever happened, this save no longer holds its path
    mine_bytes = sum(f.size for f in written.files) if written else 0
    return SaveResult(job.url, job.opts.step, job.framework, mine_bytes, totals.total_bytes,
                      totals.metadata_bytes, totals.files, time.perf_counter() - job.t0, job.phases, hit,
                      sources.stager.peak_bytes if sources.stager is not None else 0)


def _start_overlapped(job: _Job, assignment: Assignment, hit: bool, sources: _Sources,
                      state: dict[str, Any]) -> SaveHandle:
    """snapshot="overlapped": the copy and then the write run on the save's thread; training's
    writers wait for the copy through the hooks of ``snapshot.begin``. Written through (host
    tensors, a page-cached storage: ``write_through``), there is no copy: they wait for the
    write to have taken every piece."""
    stager = sources.stager
    snap = snapshot.begin(state, stager.changed if stager is not None else lambda: None)
    job.snapshot = snap
    handle = SaveHandle(job.url, job.opts.step, snap)
    # The collector stays paused until the copy is done: collecting what this save allocated
    # runs on the save's thread, not in save() (2-7 ms of its return, measured here).
    release_gc = gc_pause.hold()

    def publish(events: dict[Any, Any]) -> None:
        snap.events = events
        snap.queued.set()

    def work() -> SaveResult:
        t = time.perf_counter()
        if isinstance(stager, WriteThroughStager):  # the write is the copy: done once written
            def written() -> None:
                job.phases["stage"] = time.perf_counter() - t
                snap.finished()
                release_gc()

            stager.when_done(written)
            try:
                return _finish(job, assignment, hit, sources)
            finally:
                stager.finish()  # whatever happened, training no longer waits for this save
        if sources.capped:  # rounds: the copy reuses memory the writer has drained
            release_gc()
            sources.stage_in_background(on_queued=publish, on_done=snap.finished)
            return _finish(job, assignment, hit, sources)
        try:
            if stager is not None:
                stager.run(on_queued=publish)
        except BaseException:  # kept by the stager: its pieces raise it to the writer
            pass
        finally:
            snap.finished()
            job.phases["stage"] = time.perf_counter() - t
            release_gc()
        return _finish(job, assignment, hit, sources)

    handle._start(work, stager.device if stager is not None else None, deferred=True)
    set_pending(handle)
    return handle


def save(url: str, state: dict[str, Any], opts: SaveOptions) -> SaveResult | SaveHandle:
    """Save ``state`` to ``url`` as :func:`bytecheckpoint.save` documents (``opts``: its options)."""
    with save_turn():  # one save at a time, from any thread
        wait_pending()  # the arena and the save group are never shared
        try:
            with gc_paused():  # the foreground part: all of a synchronous save, an async one's snapshot
                return _save(url, state, opts)
        finally:
            launch_pending()  # an overlapped save's copy and write (never left unstarted)


def _refuse_process_private(url: str, storage: Storage, comm: Communicator) -> None:
    """``mem://`` is one process's memory: the files other ranks wrote would stay in theirs, and
    the coordinator would commit a checkpoint no process can load while every rank reported
    success. Refused on every rank, before anything is written."""
    if storage.scheme == "mem" and comm.distributed and comm.world_size > 1:
        raise InvalidArgumentError(
            f"{url} is in-memory storage of one process, but this save runs on "
            f"{comm.world_size} ranks in separate processes; save to shm:// (the ranks of one host) "
            "or to a file system or object store every rank reaches")


def _save(url: str, state: dict[str, Any], opts: SaveOptions) -> SaveResult | SaveHandle:
    t0 = time.perf_counter()
    comm = Communicator(opts.process_group, dedicated=True)
    stamp_rank()
    # The first few tensors only: a DTensor state shows one at once, and walking a large
    # plain model's every parameter cost ~1 us each, every call (flattening stamps it later).
    stamp_topology(itertools.islice(state_tensors(state), 16))
    storage, path = open_storage(url)
    if opts.step is not None:
        set_context(step=opts.step)
    job = _Job(url, storage, path, comm, opts, t0)
    with span("save", path=url, step=opts.step, async_save=opts.async_save) as total:
        job.call_id = total.call_id
        t = time.perf_counter()
        local_error: BaseException | None = None
        with span("save.collect"):
            try:
                check_save_settings()  # named here, not defaulted where they are read
                write_slots.check_setting()
                job.host = host_files.resolve(opts.files_per, opts.host_size, comm.rank, comm.world_size)
                split_checkpoint_path(path, saving=True)
                _refuse_process_private(url, storage, comm)
                _collect(job, state, opts.framework, opts.fqn_map)
            except BaseException as exc:  # a KeyboardInterrupt too: raised after the plan round
                local_error = exc
        job.phases["collect"] = time.perf_counter() - t
        t = time.perf_counter()
        with span("save.plan") as plan_span:
            if local_error is None:
                job.key = structure_key(job.local, job.boxes_digest, framework=job.framework,
                                        layout=job.layout,
                                        kinds=job.flat.kinds, global_ranks=comm.global_ranks,
                                        chunk_bytes=opts.chunk_bytes,
                                        files="rank" if job.host is None else f"host{job.host.size}")
            entry = plan_cache.get(comm.global_ranks)
            # Cached plans write before any coordinator step, so they need a store with an
            # atomic rename; object stores (metadata-last commit) plan every save.
            hit = (local_error is None and entry is not None and entry.key == job.key
                   and storage.commit_mode is CommitMode.RENAME)
            if hit and job.host is not None:  # else Replan: every rank plans, below
                assert entry is not None
                hit = _agree_on_hit(job, entry)
            plan_span.set(cached=hit)
            if hit:
                assert entry is not None
                save_id = entry.save_id()
                assignment = Assignment(staging_path(path, save_id), save_id, entry.items,
                                         entry.shared_keys, entry.plan_id, entry.write_share,
                                         entry.replicas or [])
            else:
                plan_cache.drop(comm.global_ranks)
                assignment = _plan(job, local_error)
        _take_replica_samples(job, assignment)
        job.phases["plan"] = time.perf_counter() - t
        if not opts.async_save:
            # Training waits for this save, so only its wall time counts, not the CPU that direct
            # writes spare; an async save's writers keep their part of the disk, so that training
            # never waits on another rank's turn.
            job.storage = job.storage.for_waited_writes(assignment.write_share)

        t = time.perf_counter()
        sources = _Sources(job, assignment, stage=opts.async_save,
                           locators=entry.locators if hit and entry is not None else None)
        if not opts.async_save:
            sources.stage_in_background()
            result = _finish(job, assignment, hit, sources)
            total.set(bytes=result.bytes_written, framework=job.framework, cached_plan=hit)
            return result

        stager = sources.stager
        device = stager.device if stager is not None else None
        if opts.snapshot == SnapshotMode.OVERLAPPED:
            handle = _start_overlapped(job, assignment, hit, sources, state)
            job.phases["stage"] = 0.0  # copied in the background (save.stage span)
            handle.blocking_s = time.perf_counter() - t0
            total.set(framework=job.framework, cached_plan=hit, blocking_s=handle.blocking_s)
            return handle
        handle = SaveHandle(url, opts.step)
        # A D2H copy is DMA: the writer may start on the first pieces while the rest are
        # copied. On CPU the copy and the writer would compete for the same cores while
        # training waits, so the writer starts once the snapshot is complete.
        # A bounded arena is reused round by round, so its writer must drain it meanwhile:
        # save() returns once the last round is copied.
        overlap = stager is not None and (stager.cuda or sources.capped)
        if overlap:
            handle._start(lambda: _finish(job, assignment, hit, sources), device)
        stage_error: BaseException | None = sources.error
        if stager is not None:
            try:
                stager.run()  # the snapshot
            except BaseException as exc:
                stage_error = exc
                if isinstance(exc, Exception):
                    stage_error = StagingError(f"copying this save's tensors into host memory "
                                               f"failed: {exc}")
                    stage_error.__cause__ = exc
        job.phases["stage"] = time.perf_counter() - t
        if not overlap:
            handle._start(lambda: _finish(job, assignment, hit, sources), device)
        set_pending(handle)
        handle.blocking_s = time.perf_counter() - t0
        total.set(framework=job.framework, cached_plan=hit, blocking_s=handle.blocking_s)
    if stage_error is not None:
        # The background still reports the failure to the other ranks; then raise here.
        exc = handle.exception()
        raise stage_error from exc
    return handle


__all__ = ["SaveHandle", "SaveResult", "save"]
