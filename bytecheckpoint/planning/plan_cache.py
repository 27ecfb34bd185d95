"""The plan cache: a repeated save of an unchanged state structure skips global planning.

Each rank keeps, per process group, the structure key of its last successful save (a hash
of what planning depends on: the ranks, framework, layout, each tensor's key, dtype, global
shape and the boxes this rank holds, the shared objects' keys, the storage kinds), the
assignment it received, and an id of that plan. The coordinator also keeps the global plan
and the metadata template.

A rank whose key matches writes at once, into a staging directory named after the plan id
and a per-plan save counter that every rank advances in step, so no message is needed to
agree on it. Ranks do not ask each other whether their caches hit: the first message of a
save (the gather every save makes) carries either a local plan or "written under plan P,
save n", and the coordinator commits only when every rank wrote under the same plan and
save number. Otherwise it has every rank plan again (or, for an async save, fail with a
clear error), so a structure that changed on some ranks only can never be committed with a
stale plan.
"""

from __future__ import annotations

import marshal
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import xxhash

from .global_plan import GlobalSavePlan, LocalSavePlan, ReplicaRows, WriteItem
from .save_metadata import MetadataTemplate


@dataclass
class CacheEntry:
    key: str
    plan_id: str
    seq: int  # saves committed under this plan so far, minus one
    items: list[WriteItem]
    shared_keys: list[str]
    plan: GlobalSavePlan | None = None  # coordinator only
    template: MetadataTemplate | None = None  # coordinator only
    # Opaque to planning: the engine's per-item positions in the rank's shards, a function
    # of the boxes the key covers (engine/save.py, _locate).
    locators: list[Any] | None = None
    write_share: Fraction | None = None  # this rank's part of its host's bytes (engine/save.py)
    replicas: ReplicaRows | None = None  # this rank's rows in the replica check (engine/replicas.py)

    def save_id(self) -> str:
        """The id of the next save under this plan (the same on every rank)."""
        return f"{self.plan_id}n{self.seq + 1}"


def boxes_digest(items: list[WriteItem]) -> bytes:
    """A digest of a local plan's boxes (key, dtype, global shape, offsets, lengths), taken
    while the local plan is collected so that a cache hit has nothing left to walk."""
    return rows_digest([(i.key, i.dtype, i.shape, i.box) for i in items])


def rows_digest(rows: list[tuple[str, str, tuple[int, ...], Any]]) -> bytes:
    """:func:`boxes_digest` of ``(key, dtype, global shape, box)`` rows, the same value as of
    the ``WriteItem`` s they make: a save builds the items only when it must plan."""
    # marshal: one C-level serialisation of plain tuples (the digest never leaves this process)
    return xxhash.xxh3_128_digest(marshal.dumps(
        [(k, d, s, b.offsets, b.lengths) for k, d, s, b in rows]))


def structure_key(local: LocalSavePlan, boxes: bytes, *, framework: str, layout: dict,
                  kinds: dict[str, str], global_ranks: list[int], chunk_bytes: int,
                  files: str = "rank") -> str:
    """A hash of everything the global plan depends on, besides sizes of packed objects
    (they only tilt the balance, never the correctness, of a plan). ``boxes`` is
    :func:`boxes_digest` of ``local.items``; ``files`` is the file layout (``rank`` or
    ``host<size>``): the cached metadata template follows it."""
    h = xxhash.xxh3_128()
    h.update(repr((framework, sorted(layout.items()), sorted(kinds.items()), global_ranks, local.rank,
                   chunk_bytes, sorted(local.shared), files)).encode())
    h.update(boxes)
    return h.hexdigest()


_CACHE: dict[tuple[int, ...], CacheEntry] = {}
_LOCK = threading.Lock()


def get(group_ranks: list[int]) -> CacheEntry | None:
    with _LOCK:
        return _CACHE.get(tuple(group_ranks))


def put(group_ranks: list[int], entry: CacheEntry) -> None:
    with _LOCK:
        _CACHE[tuple(group_ranks)] = entry


def drop(group_ranks: list[int]) -> None:
    with _LOCK:
        _CACHE.pop(tuple(group_ranks), None)


def clear() -> None:
    """Forget every cached plan (the next save of each group plans from scratch)."""
    with _LOCK:
        _CACHE.clear()
