"""Collectives used for planning and commit, on a CPU (gloo) side channel.

Planning messages are small Python objects, so they go over gloo even when training uses
NCCL: no accelerator memory, no lazy NCCL channel setup (paper §5). Every collective step
carries either a value or an error, so one rank's failure reaches every rank as an
exception instead of leaving the others blocked in a collective until the timeout.

Large worlds use a tree instead of gloo's flat object collectives (paper §5): the ranks of a
host send to their host leader, host leaders to the leader of their group of ``fanout``
hosts, and so on up to the coordinator; scatter and broadcast walk the same tree down. A
rank hears from at most its host's ranks plus ``fanout - 1`` leaders per level above (41 at
8,960 ranks, 8 per host, fan-out 16), where a flat gather makes the coordinator receive
from every rank. The tree is point-to-point sends of pickled bytes (the trust model of
torch's object collectives) on the same gloo group (no subgroups to create), and gives the
same results as the flat version. Settings (environment, or ``Communicator`` arguments):

- ``BCP_COMM_TREE``: ``1`` always, ``0`` never, unset: from ``BCP_COMM_TREE_MIN_WORLD``
  ranks on (default 256);
- ``BCP_COMM_HOST_SIZE``: ranks per host (default ``LOCAL_WORLD_SIZE``, else the fan-out);
  hosts are blocks of consecutive ranks, as torchrun numbers them;
- ``BCP_COMM_FANOUT``: children per leader above the host level (default 16).
"""

from __future__ import annotations

import functools
import os
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import (
    CheckpointError,
    CheckpointReplacedError,
    InvalidSettingError,
    ProcessGroupError,
    RankFailedError,
)

T = TypeVar("T")
_GLOO_GROUPS: dict[Any, Any] = {}
_SAVE_GROUPS: dict[tuple[int, ...], Any] = {}
_STORE_ALIGNMENTS: dict[tuple[int, ...], int] = {}  # per set of ranks: see _same_group_count_by_store


@dataclass(frozen=True)
class Outcome:
    """A rank's contribution to a checked collective: a value or an error description."""

    value: Any = None
    error: str | None = None
    error_type: str | None = None

    @classmethod
    def failure(cls, exc: BaseException) -> Outcome:
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return cls(error=detail, error_type=type(exc).__name__)


def _control_group(group: Any) -> Any:
    """The gloo group to plan on: ``group`` itself when it is gloo, else a gloo twin."""
    backend = dist.get_backend(group)
    if backend == "gloo" or "cpu:gloo" in str(backend):
        return group
    key = group if group is not None else "default"
    if key not in _GLOO_GROUPS:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        _GLOO_GROUPS[key] = gloo_group_of(ranks)
    return _GLOO_GROUPS[key]


def gloo_group_of(ranks: list[int], parent: Any = None) -> Any:
    """A new gloo group of ``ranks``, created by its members alone.

    A subgroup (a load on a pipeline stage's group, called by its members only) is created
    with local synchronization: its name comes from its ranks and the number of groups the
    process already has. That count differs between ranks whose histories differ (one rank
    failed before creating a group its peers made; a save on ranks [0, 1] made a save group
    that rank 2 has not, before a save on [0, 1, 2]), and then the members wait for each
    other under different names forever. ``parent``, a group of exactly ``ranks`` that can
    carry CPU tensors, lets them agree on the count first (:func:`_same_group_count`). A
    group of the whole world needs no such name: every rank is a member and calls this, so
    the plain world-wide creation (a shared counter) is both correct and immune to differing
    histories. Without such a parent (an NCCL-only group carries no CPU tensor) the members
    agree through the job's store instead (:func:`_same_group_count_by_store`): no subgroup
    is made without agreeing first."""
    if len(ranks) == dist.get_world_size():
        return dist.new_group(ranks=list(ranks), backend="gloo")
    if parent is not None and _carries_cpu(parent):
        _same_group_count(parent)
    else:  # an NCCL-only group carries no CPU tensor: the members meet in the job's store
        _same_group_count_by_store(ranks)
    return dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True)


def _carries_cpu(group: Any) -> bool:
    backend = str(dist.get_backend(group))
    return backend == "gloo" or "cpu:gloo" in backend


def _same_group_count(group: Any) -> None:
    """Bring this rank's count of process groups up to the largest in ``group`` with groups
    of this rank alone, so the next subgroup its members create gets one name on all of
    them (torch names a locally synchronized group by its ranks and that count)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    if names is None:  # another torch: nothing to align by
        return
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, torch.tensor([len(names)], dtype=torch.int64), group=group)
    for _ in range(int(max(c.item() for c in counts)) - len(names)):
        dist.new_group(ranks=[dist.get_rank()], backend="gloo", use_local_synchronization=True)


def _same_group_count_by_store(ranks: list[int]) -> None:
    """:func:`_same_group_count` for members that share no group able to carry a CPU tensor:
    each writes its count under a key of the default store named by the ranks and how many
    times this process aligned for them (members align for a group together, in one order),
    then waits for the others' and pads to the largest."""
    c10d = dist.distributed_c10d
    names = getattr(getattr(c10d, "_world", None), "pg_names", None)
    get_store = getattr(c10d, "_get_default_store", None)
    if names is None or get_store is None:  # another torch: nothing to align by
        return
    members = tuple(sorted(ranks))
    seq = _STORE_ALIGNMENTS[members] = _STORE_ALIGNMENTS.get(members, 0) + 1
    prefix = f"bytecheckpoint/group-count/{'_'.join(map(str, members))}/{seq}"
    store = get_store()
    keys = [f"{prefix}/{r}" for r in members]
    try:
        store.set(f"{prefix}/{dist.get_rank()}", str(len(names)))
        store.wait(keys)
        top = max(int(store.get(k)) for k in keys)
    except RuntimeError as exc:  # the store's timeout: a member never came (crashed, or not saving)
        raise group_failure(exc, "group creation", len(members)) from exc
    for _ in range(top - len(names)):
        dist.new_group(ranks=[dist.get_rank()], backend="gloo", use_local_synchronization=True)


def _save_group(group: Any) -> Any:
    """A gloo group of the same ranks used only by saves, created on the first save.

    An async save finishes its collectives on a background thread; on a group of their own
    they never interleave with the training thread's collectives. Saves run one at a time,
    so the group is never used by two threads at once."""
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if ranks not in _SAVE_GROUPS:
        # Only the member ranks take part in creating it (every one of them is saving).
        _SAVE_GROUPS[ranks] = gloo_group_of(list(ranks), group if group is not None else dist.group.WORLD)
    return _SAVE_GROUPS[ranks]


def group_failure(exc: RuntimeError, op: str, world: int) -> ProcessGroupError:
    """A failed ``torch.distributed`` call, by name: gloo raises a bare RuntimeError
    ("Connection closed by peer", a timeout) that names no rank and no remedy."""
    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return ProcessGroupError(
        f"the process group failed in a checkpoint's {op} ({detail}): one of its {world} ranks "
        "crashed, was killed or lost its connection, or did not answer within the group's "
        "timeout. The group cannot carry another collective: restart the job and load its "
        "latest committed checkpoint")


def _transport(fn: Callable[..., T]) -> Callable[..., T]:
    """Raise the failure of a collective of ``Communicator`` as a ``ProcessGroupError``."""
    @functools.wraps(fn)
    def wrapper(self: Communicator, *args: Any, **kwargs: Any) -> T:
        try:
            return fn(self, *args, **kwargs)
        except RuntimeError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise group_failure(exc, fn.__name__, self.world_size) from exc
    return wrapper


TREE_MIN_WORLD = 256
DEFAULT_FANOUT = 16


@dataclass(frozen=True)
class TreeNode:
    """One rank's place in the coordination tree (group ranks; the root is rank 0)."""

    parent: int | None
    children: tuple[int, ...]  # in the order this rank receives from them
    subtree: tuple[int, ...]  # this rank and everything below it, ascending


@functools.lru_cache(maxsize=8)
def tree_layout(world: int, host_size: int, fanout: int) -> tuple[TreeNode, ...]:
    """The tree for ``world`` ranks: blocks of ``host_size`` ranks under their first rank,
    then blocks of ``fanout`` leaders under their first leader, level by level. Pure, so
    every rank computes the same tree with no message."""
    if world < 1 or host_size < 1 or fanout < 2:
        raise ValueError(f"bad tree: world={world} host_size={host_size} fanout={fanout}")
    parent: list[int | None] = [None] * world
    children: list[list[int]] = [[] for _ in range(world)]
    level = list(range(world))
    block = host_size
    while len(level) > 1:
        leaders = []
        for i in range(0, len(level), block):
            head, rest = level[i], level[i + 1 : i + block]
            leaders.append(head)
            for r in rest:
                parent[r] = head
                children[head].append(r)
        level, block = leaders, fanout
    subtree: list[list[int]] = [[r] for r in range(world)]
    for r in sorted(range(world), key=lambda r: -_depth(parent, r)):  # leaves first
        p = parent[r]
        if p is not None:
            subtree[p].extend(subtree[r])
    return tuple(TreeNode(parent[r], tuple(children[r]), tuple(sorted(subtree[r]))) for r in range(world))


def _depth(parent: list[int | None], r: int) -> int:
    d = 0
    while parent[r] is not None:
        r, d = parent[r], d + 1  # type: ignore[assignment]
    return d


def _env_int(name: str, default: int | None) -> int | None:
    """A whole number >= 1 from the environment; unset or empty: ``default``. Anything else is
    refused by name (a 0 or a typo silently meant the default before)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidSettingError(f"{name} = {raw!r} is not a whole number >= 1: unset it or give one")
    return value


def host_size_setting(explicit: int | None = None) -> int | None:
    """Ranks per host: ``explicit``, else ``BCP_COMM_HOST_SIZE``, else ``LOCAL_WORLD_SIZE``
    (torchrun sets it); None when none is known. Hosts are blocks of consecutive ranks."""
    return explicit or _env_int("BCP_COMM_HOST_SIZE", None) or _env_int("LOCAL_WORLD_SIZE", None)


def tree_settings(world: int, *, tree: bool | None = None, host_size: int | None = None,
                  fanout: int | None = None) -> tuple[int, int] | None:
    """``(host_size, fanout)`` when ``world`` ranks coordinate through a tree, else None."""
    if tree is None:
        flag = os.environ.get("BCP_COMM_TREE", "").strip().lower()
        if flag in ("1", "true", "on", "yes"):
            tree = True
        elif flag in ("0", "false", "off", "no"):
            tree = False
        elif flag:
            raise InvalidSettingError(f"BCP_COMM_TREE = {flag!r}: use 1 (coordinate through a tree), "
                                      "0 (flat), or unset it (a tree from BCP_COMM_TREE_MIN_WORLD ranks)")
        else:
            tree = world >= (_env_int("BCP_COMM_TREE_MIN_WORLD", TREE_MIN_WORLD) or TREE_MIN_WORLD)
    if not tree or world < 2:
        return None
    fan = fanout or _env_int("BCP_COMM_FANOUT", DEFAULT_FANOUT) or DEFAULT_FANOUT
    host = host_size_setting(host_size) or fan
    return max(1, host), max(2, fan)


class Communicator:
    """Rank, world size and checked collectives over one process group (or none).

    ``dedicated=True`` runs them on the save group (see :func:`_save_group`) instead of the
    control group. ``tree``/``host_size``/``fanout`` override the tree settings (see the
    module docstring); the results are the same either way."""

    def __init__(self, group: Any = None, *, dedicated: bool = False, tree: bool | None = None,
                 host_size: int | None = None, fanout: int | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.group = _save_group(group) if dedicated else _control_group(group)
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self.global_ranks = dist.get_process_group_ranks(self.group)
        else:
            self.group = None
            self.rank, self.world_size, self.global_ranks = 0, 1, [0]
        settings = tree_settings(self.world_size, tree=tree, host_size=host_size, fanout=fanout)
        self.tree: tuple[TreeNode, ...] | None = None
        self.node: TreeNode | None = None
        if self.distributed and settings is not None:
            self.tree = tree_layout(self.world_size, *settings)
            self.node = self.tree[self.rank]

    COORDINATOR = 0

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.COORDINATOR

    def _coordinator_global(self) -> int:
        return self.global_ranks[self.COORDINATOR]

    @_transport
    def gather(self, outcome: Outcome) -> list[Outcome] | None:
        """All outcomes on the coordinator (indexed by group rank), None elsewhere."""
        if not self.distributed:
            return [outcome]
        if self.node is not None:
            return self._tree_gather(outcome)
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(outcome, out, dst=self._coordinator_global(), group=self.group)
        return out

    @_transport
    def scatter(self, per_rank: list[Outcome] | None) -> Outcome:
        """Give rank ``i`` the coordinator's ``per_rank[i]``."""
        if not self.distributed:
            assert per_rank is not None
            return per_rank[0]
        if self.node is not None:
            return self._tree_scatter(per_rank)
        received: list[Any] = [None]
        dist.scatter_object_list(
            received, per_rank if self.is_coordinator else None,
            src=self._coordinator_global(), group=self.group,
        )
        return received[0]

    @_transport
    def broadcast(self, outcome: Outcome | None) -> Outcome:
        """The coordinator's outcome on every rank."""
        if not self.distributed:
            assert outcome is not None
            return outcome
        if self.node is not None:
            return self._tree_broadcast(outcome)
        box = [outcome]
        dist.broadcast_object_list(box, src=self._coordinator_global(), group=self.group)
        return box[0]

    @_transport
    def all_gather(self, outcome: Outcome) -> list[Outcome]:
        if not self.distributed:
            return [outcome]
        if self.node is not None:
            gathered = self._tree_gather(outcome)
            return self._tree_broadcast(Outcome(value=gathered) if gathered is not None else None).value
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, outcome, group=self.group)
        return out

    @_transport
    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        if not self.distributed:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    # -- point to point (group ranks), for the tree and for host files ----------------------
    def send_object(self, obj: Any, to: int) -> None:
        """Send a picklable value to group rank ``to`` (which calls ``recv_object``)."""
        self._send(obj, to)

    def recv_object(self, src: int) -> Any:
        return pickle.loads(self._recv_raw(src))

    def send_tensor(self, tensor: torch.Tensor, to: int, timeout: timedelta | None = None) -> None:
        """Send a contiguous CPU tensor; the receiver posts a tensor of the same size.
        ``timeout`` replaces the group's timeout for this send (gloo sends wait for the
        receiver to post its receive)."""
        work = dist.isend(tensor, group=self.group, group_dst=to)
        if work is not None:
            work.wait() if timeout is None else work.wait(timeout)

    def recv_tensor(self, tensor: torch.Tensor, src: int, timeout: timedelta | None = None) -> None:
        work = dist.irecv(tensor, group=self.group, group_src=src)
        if work is not None:
            work.wait() if timeout is None else work.wait(timeout)

    # -- the tree: point-to-point sends of pickled bytes along TreeNode edges ---------------
    def _send(self, obj: Any, to: int, raw: bytes | None = None) -> None:
        data = raw if raw is not None else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        dist.send(torch.tensor([len(data)], dtype=torch.int64), group=self.group, group_dst=to)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), group=self.group, group_dst=to)

    def _recv_raw(self, src: int) -> bytes:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, group=self.group, group_src=src)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(buf, group=self.group, group_src=src)
        return buf.numpy().tobytes()

    def _tree_gather(self, outcome: Outcome) -> list[Outcome] | None:
        node = self.node
        assert node is not None
        mine: dict[int, Outcome] = {self.rank: outcome}
        for child in node.children:  # each child sends its whole subtree's outcomes at once
            mine.update(pickle.loads(self._recv_raw(child)))
        if node.parent is not None:
            self._send(mine, node.parent)
            return None
        return [mine[r] for r in range(self.world_size)]

    def _tree_scatter(self, per_rank: list[Outcome] | None) -> Outcome:
        node = self.node
        assert node is not None
        if node.parent is None:
            assert per_rank is not None
            table = dict(enumerate(per_rank))
        else:
            table = pickle.loads(self._recv_raw(node.parent))
        assert self.tree is not None
        for child in node.children:  # each child gets only its subtree's outcomes
            self._send({r: table[r] for r in self.tree[child].subtree}, child)
        return table[self.rank]

    def _tree_broadcast(self, outcome: Outcome | None) -> Outcome:
        node = self.node
        assert node is not None
        if node.parent is None:
            raw = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            raw = self._recv_raw(node.parent)
        for child in node.children:  # forward the bytes as received: pickled once, at the root
            self._send(None, child, raw)
        return outcome if node.parent is None else pickle.loads(raw)

    def check_all(self, local_error: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank failed ``what``. When none did, that is one small
        all-reduce; every rank's outcome is gathered (two collectives and pickling: 10 ms of
        a 0.5 s load on 4 ranks here) only to name the ranks that failed."""
        if not self.any_rank(local_error is not None):
            return
        outcomes = self.all_gather(
            Outcome.failure(local_error) if local_error is not None else Outcome(value=True)
        )
        raise_failures(outcomes, what, local_error)


def summarize_failures(outcomes: list[Outcome]) -> Outcome | None:
    """One outcome naming every failed rank (``value``: rank -> error), or None."""
    bad = {i: o.error for i, o in enumerate(outcomes) if o.error is not None}
    if not bad:
        return None
    lines = "\n".join(f"  rank {r}: {msg}" for r, msg in sorted(bad.items()))
    return Outcome(value=bad, error=f"failed on {len(bad)} rank(s):\n{lines}")


# Errors about the checkpoint itself rather than one rank's part: a rank that did not see one
# raises it all the same (with the seeing rank's message), so every rank can act on its type.
_SHARED_ERRORS: dict[str, type[CheckpointError]] = {"CheckpointReplacedError": CheckpointReplacedError}


def _shared_error(outcomes: list[Outcome], what: str, local_error: BaseException | None
                  ) -> BaseException | None:
    if isinstance(local_error, tuple(_SHARED_ERRORS.values())):
        return local_error
    for rank, o in enumerate(outcomes):
        cls = _SHARED_ERRORS.get(o.error_type or "")
        if cls is None or o.error is None:
            continue
        head, sep, message = o.error.partition(": ")  # "module.ClassName: message"
        if not (sep and head.endswith(cls.__name__)):
            message = o.error
        error = cls(f"{what} failed on rank {rank}: {message}")
        error.__cause__ = local_error
        return error
    return None


def raise_failures(outcomes: list[Outcome], what: str, local_error: BaseException | None = None) -> None:
    """Raise one error naming every failed rank; re-raise the local error type when it is ours.
    An error about the checkpoint itself (``_SHARED_ERRORS``) is raised by every rank."""
    summary = summarize_failures(outcomes)
    if summary is None:
        return
    if local_error is not None and not isinstance(local_error, Exception):
        raise local_error  # KeyboardInterrupt, SystemExit: the others were told; stop as asked
    shared = _shared_error(outcomes, what, local_error)
    if shared is not None:
        raise shared
    if isinstance(local_error, RankFailedError):
        # This rank only relays another's failure ("rank 1 failed while reading"): the
        # summary of the ranks that failed themselves says why they did.
        own = summarize_failures([o if o.error_type != "RankFailedError" else Outcome(value=True)
                                  for o in outcomes])
        if own is None:
            raise local_error  # every failure is one already summed up: not wrapped in itself again
        raise RankFailedError(f"{what} {(own or summary).error}", (own or summary).value) from local_error
    # A rank that failed itself raises its own, more specific error.
    if isinstance(local_error, CheckpointError):
        raise local_error
    error = RankFailedError(f"{what} {summary.error}", summary.value)
    if local_error is not None:
        raise error from local_error
    raise error
