"""The save workflow, run by every rank.

  1. local plan      flatten the state, ask the planner for this rank's boxes
  2. global plan     coordinator: dedup, balance, validate; create the staging directory
  3. write           every rank writes its storage files (checksums computed as it writes)
  4. commit          coordinator: metadata last, rename into place, move ``latest``
Each step ends in a collective that carries values or errors, so every rank returns the
same result or raises.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from telemetry import set_context, span

from .. import codec, errors
from ..checksums import DEFAULT_CHUNK_BYTES
from ..comm import Communicator, Outcome, summarize_failures
from ..dtypes import dtype_name, safetensors_code
from ..errors import RankFailedError
from ..integrity import abandon, begin_save, commit, split_checkpoint_path, update_latest
from ..metadata import (
    METADATA_FILE,
    BoxTable,
    ByteMeta,
    CheckpointMetadata,
    FileMeta,
    ObjectMeta,
    TensorMeta,
)
from ..planners import LocalShard, get_planner
from ..planning import GlobalSavePlan, LocalSavePlan, WriteItem, plan_save
from ..sharding import Box
from ..state import KIND_EXTRA, FlatState, flatten_state
from ..storage import Storage, open_storage
from .files import Piece, write_file

_KIND_ORDER = ("model", "optim", "extra")


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


@dataclass(frozen=True)
class _Assignment:
    staging: str
    save_id: str
    items: list[WriteItem]
    shared_keys: list[str]


@dataclass(frozen=True)
class _RankWrite:
    files: list[FileMeta]
    boxes: list[tuple[str, Box, ByteMeta]]
    objects: list[ObjectMeta]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def _entry_name(item: WriteItem) -> str:
    return f"{item.key}@{','.join(map(str, item.box.offsets))}"


def _source_of(item: WriteItem, shards: list[LocalShard]):
    """The view of this rank's data that holds ``item.box`` (a piece of a held box)."""
    for shard in shards:
        if shard.box.intersect(item.box) == item.box:
            view = shard.data[item.box.relative_to(shard.box).slices()]
            return lambda: _tensor_bytes(view)
    raise RuntimeError(f"{item.key}: this rank holds no box containing {item.box}")


def _local_plan(
    state: Any, framework: str | None, comm: Communicator, fqn_map: Callable[[str], str] | None
) -> tuple[FlatState, str, dict[str, list[LocalShard]], LocalSavePlan, dict[str, bytes], dict[str, Any]]:
    flat = flatten_state(state, fqn_map=fqn_map)
    planner = get_planner(framework, flat, comm)
    shards: dict[str, list[LocalShard]] = {}
    items: list[WriteItem] = []
    for key, tensor in flat.tensors.items():
        local = planner.pieces(key, tensor)
        shards[key] = local
        dtype = dtype_name(tensor.dtype)
        shape = planner.global_shape(tensor)
        items.extend(WriteItem(key, dtype, shape, s.box) for s in local)
        if not local:  # a rank may hold nothing of a tensor; still announce its shape
            items.append(WriteItem(key, dtype, shape, Box((0,) * len(shape), (0,) * len(shape))))
    blobs = {f"shared:{k}": codec.encode(v) for k, v in flat.shared_objects.items()}
    shared = {k: (len(b), xxhash.xxh3_64_intdigest(b)) for k, b in blobs.items()}
    blobs.update({f"rank:{k}": codec.encode(v) for k, v in flat.rank_objects.items()})
    own_bytes = sum(len(b) for k, b in blobs.items() if k.startswith("rank:"))
    plan = LocalSavePlan(comm.rank, items, own_bytes,
                         {k[len("shared:") :]: v for k, v in shared.items()})
    return flat, planner.name, shards, plan, blobs, planner.layout(flat, comm)


def _write_rank(
    storage: Storage, assignment: _Assignment, flat: FlatState, shards: dict[str, list[LocalShard]],
    blobs: dict[str, bytes], rank: int, chunk_bytes: int,
) -> _RankWrite:
    by_kind: dict[str, list[tuple[WriteItem | None, Piece]]] = {k: [] for k in _KIND_ORDER}
    for item in assignment.items:
        piece = Piece(_entry_name(item), safetensors_code(item.dtype), item.box.lengths,
                      item.nbytes, _source_of(item, shards[item.key]))
        by_kind[flat.kind_of(item.key)].append((item, piece))
    mine = {f"shared:{k}" for k in assignment.shared_keys}
    for name, blob in blobs.items():
        if name.startswith("shared:") and name not in mine:
            continue  # another holder of this object writes it
        piece = Piece(f"__object__/{name}", "U8", (len(blob),), len(blob),
                      lambda b=blob: memoryview(b))
        by_kind[KIND_EXTRA].append((None, piece))

    files, boxes, objects = [], [], []
    for kind in _KIND_ORDER:
        entries = by_kind[kind]
        if not entries:
            continue
        fname = f"{kind}-{rank:05d}.safetensors"
        with span("save.write", path=fname, kind=kind) as sp:
            size, written = write_file(
                storage, storage.join(assignment.staging, fname), [p for _, p in entries],
                chunk_bytes, {"format": "bytecheckpoint", "rank": str(rank), "kind": kind},
            )
            sp.set(bytes=size)
        files.append(FileMeta(fname, size, rank, kind))
        for (item, piece), w in zip(entries, written):
            bm = ByteMeta(fname, w.byte_offset, w.byte_length, w.checksums)
            if item is not None:
                boxes.append((item.key, item.box, bm))
            else:
                scope, key = piece.name[len("__object__/") :].split(":", 1)
                objects.append(ObjectMeta(key, None if scope == "shared" else rank, bm))
    return _RankWrite(files, boxes, objects)


def build_metadata(
    plan: GlobalSavePlan, writes: list[_RankWrite], *, framework: str, world_size: int,
    layout: dict[str, Any], step: int | None, user_metadata: dict[str, Any], chunk_bytes: int,
) -> CheckpointMetadata:
    keys = sorted(plan.tensors)
    index = {k: i for i, k in enumerate(keys)}
    tensors = [TensorMeta(k, plan.tensors[k][0], tuple(plan.tensors[k][1])) for k in keys]
    files = [f for w in writes for f in w.files]
    file_index = {f.name: i for i, f in enumerate(files)}
    rows = sorted(((index[k], box, bm) for w in writes for k, box, bm in w.boxes),
                  key=lambda r: (r[0], r[1]))
    offsets = [o for _, box, _ in rows for o in box.offsets]
    lengths = [n for _, box, _ in rows for n in box.lengths]
    nd = np.array([box.ndim for _, box, _ in rows], dtype=np.int64)
    n_chunks = np.array([len(bm.checksums) for _, _, bm in rows], dtype=np.int64)
    table = BoxTable(
        tensor=np.array([r[0] for r in rows], dtype=np.int32),
        offsets=np.array(offsets, dtype=np.int64),
        lengths=np.array(lengths, dtype=np.int64),
        dim_start=np.concatenate([[0], np.cumsum(nd)[:-1]]).astype(np.int64) if rows else nd,
        file=np.array([file_index[bm.file] for _, _, bm in rows], dtype=np.int32),
        byte_offset=np.array([bm.byte_offset for _, _, bm in rows], dtype=np.int64),
        byte_length=np.array([bm.byte_length for _, _, bm in rows], dtype=np.int64),
        checksum_start=np.concatenate([[0], np.cumsum(n_chunks)[:-1]]).astype(np.int64)
        if rows else n_chunks,
        checksums=np.array([c for _, _, bm in rows for c in bm.checksums], dtype=np.uint64),
    )
    return CheckpointMetadata(
        framework=framework, world_size=world_size, tensors=tensors, boxes=table,
        objects=[o for w in writes for o in w.objects], files=files, chunk_bytes=chunk_bytes,
        layout=layout, step=step, user_metadata=user_metadata, created_at=time.time(),
    )


def _coordinator_failure(exc: BaseException) -> Outcome:
    err = Outcome.failure(exc)
    return Outcome(value={0: err.error}, error=str(exc), error_type=type(exc).__name__)


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
        raise cls(outcome.error)
    failures = outcome.value if isinstance(outcome.value, dict) else {-1: outcome.error}
    raise RankFailedError(f"{what} {outcome.error}", failures)


def save(
    url: str,
    state: dict[str, Any],
    *,
    framework: str | None = None,
    step: int | None = None,
    user_metadata: dict[str, Any] | None = None,
    process_group: Any = None,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    fqn_map: Callable[[str], str] | None = None,
) -> SaveResult:
    t0 = time.perf_counter()
    comm = Communicator(process_group)
    storage, path = open_storage(url)
    phases: dict[str, float] = {}
    if step is not None:
        set_context(step=step)
    with span("save", path=url, step=step) as total:
        # 1. local plan -------------------------------------------------------------
        local_error: BaseException | None = None
        t = time.perf_counter()
        with span("save.plan"):
            try:
                split_checkpoint_path(path)
                flat, fw, shards, local, blobs, layout = _local_plan(state, framework, comm, fqn_map)
                mine = Outcome(value=(local, fw, layout))
            except Exception as exc:
                local_error, mine = exc, Outcome.failure(exc)
            gathered = comm.gather(mine)

            # 2. global plan (coordinator) ------------------------------------------
            per_rank: list[Outcome] | None = None
            global_plan: GlobalSavePlan | None = None
            if comm.is_coordinator:
                assert gathered is not None
                failed = summarize_failures(gathered)
                if failed is None:
                    try:
                        plans = [o.value[0] for o in gathered]
                        fw, layout = gathered[0].value[1], gathered[0].value[2]
                        global_plan = plan_save(plans)
                        save_id = uuid.uuid4().hex[:12]
                        staging = begin_save(storage, path, overwrite, save_id)
                        per_rank = [
                            Outcome(value=_Assignment(staging, save_id, items, shared_keys))
                            for items, shared_keys in zip(global_plan.assignments,
                                                          global_plan.shared_assignments)
                        ]
                    except Exception as exc:
                        local_error, failed = exc, _coordinator_failure(exc)
                if failed is not None:
                    per_rank = [failed] * comm.world_size
            received = comm.scatter(per_rank)
            _raise_if_failed(received, local_error, "checkpoint planning")
            assignment: _Assignment = received.value
        phases["plan"] = time.perf_counter() - t

        # 3. write ---------------------------------------------------------------------
        t = time.perf_counter()
        try:
            written = _write_rank(storage, assignment, flat, shards, blobs, comm.rank, chunk_bytes)
            mine = Outcome(value=written)
        except Exception as exc:
            local_error, mine = exc, Outcome.failure(exc)
        gathered = comm.gather(mine)
        phases["write"] = time.perf_counter() - t

        # 4. commit (coordinator) ----------------------------------------------------------
        t = time.perf_counter()
        with span("save.commit"):
            result: Outcome | None = None
            if comm.is_coordinator:
                assert gathered is not None and global_plan is not None
                result = summarize_failures(gathered)
                if result is None:
                    try:
                        meta = build_metadata(
                            global_plan, [o.value for o in gathered], framework=fw,
                            world_size=comm.world_size, layout=layout, step=step,
                            user_metadata=dict(user_metadata or {}), chunk_bytes=chunk_bytes,
                        )
                        raw = meta.to_bytes()
                        storage.write_bytes(storage.join(assignment.staging, METADATA_FILE), raw)
                        commit(storage, assignment.staging, path, overwrite, assignment.save_id)
                        update_latest(storage, path, step, assignment.save_id)
                        result = Outcome(value=(meta.total_bytes, len(raw), len(meta.files)))
                    except Exception as exc:
                        local_error, result = exc, _coordinator_failure(exc)
                if result.error is not None:
                    abandon(storage, assignment.staging, path, assignment.save_id)
            final = comm.broadcast(result)
        phases["commit"] = time.perf_counter() - t
        _raise_if_failed(final, local_error, "checkpoint save")
        total_bytes, metadata_bytes, n_files = final.value
        mine_bytes = sum(f.size for f in written.files)
        total.set(bytes=mine_bytes, framework=fw)
    return SaveResult(url, step, fw, mine_bytes, total_bytes, metadata_bytes, n_files,
                      time.perf_counter() - t0, phases)


__all__ = ["SaveResult", "save", "build_metadata"]
