"""The save protocol: what ranks and the coordinator say to each other, one class per message.

A save's first collective is a gather to the coordinator. Each rank sends a
:class:`PlanRequest` (its local plan: the cache missed), a :class:`Written` (its files are
written under a cached plan) or, with ``files_per="host"``, a :class:`CacheHit` (its cache
hit; it writes only once every rank's has). The coordinator answers every rank with
:class:`Assign` (write these pieces), :class:`Committed` (the checkpoint is in),
:class:`UseCache` (every rank hit: write under the cached plan) or :class:`Replan` (ranks
disagreed about the cached plan; plan again). After planned writes, every rank sends its
``RankWrite`` and the coordinator broadcasts the :class:`Committed` totals.

Failures are not messages of their own: every collective carries an ``Outcome`` (see
:mod:`..runtime.comm`), whose error fields hold a rank's failure, so no rank waits for a peer
that already failed. The receivers dispatch on the message's type (``match``), never on a
position in a tuple.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ..format.checksums import DEFAULT_CHUNK_BYTES
from ..planning.global_plan import LocalSavePlan, ReplicaRows, WriteItem
from ..planning.save_metadata import RankWrite


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """Everything ``save()`` was asked for besides the path and the state, built once by
    :func:`bytecheckpoint.save` (which documents each field) and passed down unchanged."""

    framework: str | None = None
    step: int | None = None
    user_metadata: dict[str, Any] = field(default_factory=dict)
    process_group: Any = None
    overwrite: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    fqn_map: Callable[[str], str] | None = None
    async_save: bool = False
    files_per: str | None = None
    host_size: int | None = None
    snapshot: str = "blocking"  # async saves: "blocking" or "overlapped" (engine/snapshot.py)
    staging_max_bytes: int | None = None  # host staging arena bound (engine/staging_ring.py)


@dataclass(frozen=True)
class Assignment:
    """What one rank writes in one save: its pieces, the shared objects it owns, where."""

    staging: str
    save_id: str
    items: list[WriteItem]
    shared_keys: list[str]
    plan_id: str = ""  # the save that made the plan (the cache's key for "same plan")
    # This rank's part of its host's bytes: its share of the host's write slots
    # (``host_files.write_shares``); None: no share.
    write_share: Fraction | None = None
    # The rows of this rank's local plan that other ranks hold too, per replica set: their
    # sampled digests go to the coordinator with the write (``engine/replicas.py``).
    replicas: ReplicaRows = field(default_factory=list)


@dataclass(frozen=True)
class Totals:
    """The committed checkpoint's size, the same on every rank."""

    total_bytes: int  # all storage files
    metadata_bytes: int
    files: int


# -- rank -> coordinator (the first round) -------------------------------------------------


@dataclass(frozen=True)
class PlanRequest:
    """The plan cache missed on this rank: here is its local plan."""

    local: LocalSavePlan
    async_save: bool
    call: tuple[tuple[str, Any], ...] = ()  # the save() arguments every rank must agree on


@dataclass(frozen=True)
class Written:
    """This rank wrote its files under the cached plan ``plan_id`` as save ``save_id``."""

    plan_id: str
    save_id: str
    staging: str
    write: RankWrite
    shared: dict[str, tuple[int, int]]  # shared object key -> (size, xxh3-64), for the cross-check
    async_save: bool
    call: tuple[tuple[str, Any], ...] = ()  # as in PlanRequest


@dataclass(frozen=True)
class CacheHit:
    """``files_per="host"``: this rank's cache hit plan ``plan_id`` for save ``save_id``. A host
    streams to its leader, so it writes under a cached plan only once the world agrees."""

    plan_id: str
    save_id: str
    async_save: bool
    call: tuple[tuple[str, Any], ...] = ()  # as in PlanRequest


# -- coordinator -> rank -------------------------------------------------------------------


@dataclass(frozen=True)
class Assign:
    """Write these pieces (after planning)."""

    assignment: Assignment


@dataclass(frozen=True)
class Committed:
    """The checkpoint is committed."""

    totals: Totals


@dataclass(frozen=True)
class UseCache:
    """Every rank's cache hit the same plan (:class:`CacheHit`): write under it."""


@dataclass(frozen=True)
class Replan:
    """Some ranks' plan caches hit and others' did not: plan again, from scratch."""


Request = PlanRequest | Written | CacheHit
Answer = Assign | Committed | UseCache | Replan
