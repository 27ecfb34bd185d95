"""One storage file per host and kind: ``save(..., files_per="host")``.

With one file per rank and kind, a save makes ``3 x ranks`` files, and thousands of small
files load a file system's metadata server (an HDFS NameNode) more than their bytes load its
data nodes. In host mode the ranks of a host (blocks of ``host_size`` consecutive ranks of
the save group, as torchrun numbers them) hand their pieces to the host's first rank, the
*leader*, which writes one file per kind for the whole host: ``model-h00003.safetensors``
(host 3), ``optim-h00003...``, ``extra-h00003...``. The files are valid safetensors files
listing every member's entries; the metadata names the leader as their rank, and each
object keeps its owner's rank, so loads (which use byte offsets only) need no change.

Members send, point to point on the save group: a manifest (their entries, in write order,
or the error that stopped them), then per entry a status (1: bytes follow, 0: this rank
failed and sends nothing more) and the bytes in blocks of at most ``TRANSFER_BYTES``
(multiples of the checksum chunk). The leader receives into one reusable block buffer and
writes each block as it arrives, computing checksums as usual, so its memory stays bounded
whatever the members hold. Whatever goes wrong, the leader receives every manifest and
drains every stream before it returns, so no member is left blocked in a send; errors then
reach every rank through the save's next collective, as in rank mode. Storage-agnostic: the
leader writes its files sequentially through the ordinary writer of any backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from fractions import Fraction

import torch

from telemetry import span

from ..commit.protocol import data_file_name
from ..errors import InvalidArgumentError, InvalidSettingError, RankFailedError
from ..format.boxes import Box
from ..format.metadata import ByteMeta, FileMeta, ObjectMeta
from ..planning.save_metadata import RankWrite, box_columns
from ..runtime.comm import Communicator, Outcome, host_size_setting
from ..storage import Storage
from .files import Piece, transfer_block
from .writer import KIND_ORDER, Entry, pieces_by_kind, record, write_kind_file

FILES_PER_ENV = "BCP_FILES_PER"
FILES_PER = ("rank", "host")
TRANSFER_BYTES = 64 << 20  # a member's bytes travel in blocks of at most this (leader memory)
# A member's send waits until the leader has written everything of the host that comes
# before it, which may outlast the group's timeout on a large host; a leader that dies still
# fails the send at once (its connection closes).
MEMBER_WAIT = timedelta(hours=2)

Source = Callable[[], memoryview]


@dataclass(frozen=True)
class HostLayout:
    """This rank's host in the save group (group ranks)."""

    size: int  # ranks per host
    host: int  # index of this rank's host
    leader: int
    members: tuple[int, ...]  # the host's other ranks, ascending

    def file_name(self, kind: str, tag: str = "") -> str:
        return data_file_name(kind, f"h{self.host:05d}", tag)


def _files_mode(files_per: str | None) -> str:
    """``files_per``, else ``BCP_FILES_PER``, else ``"rank"`` (not validated here)."""
    return files_per or os.environ.get(FILES_PER_ENV, "").strip().lower() or "rank"


def resolve(files_per: str | None, host_size: int | None, rank: int, world: int) -> HostLayout | None:
    """The host layout of ``files_per="host"``, None for one file per rank. ``files_per``
    defaults to ``BCP_FILES_PER`` (else ``"rank"``); the host size is ``host_size``, else
    ``BCP_COMM_HOST_SIZE``, else ``LOCAL_WORLD_SIZE`` (the coordination tree's hosts)."""
    mode = _files_mode(files_per)
    if mode not in FILES_PER:
        error = InvalidArgumentError if files_per else InvalidSettingError  # both ValueErrors
        raise error(f"files_per={mode!r}: expected one of {FILES_PER} (argument or {FILES_PER_ENV})")
    if mode == "rank":
        return None
    size = host_size_setting(host_size)
    if size is None or size < 1:
        raise InvalidArgumentError(
            "files_per='host' needs the number of ranks per host: pass host_size=, or set "
            "BCP_COMM_HOST_SIZE or LOCAL_WORLD_SIZE (torchrun sets it)"
        )
    host = rank // size
    leader = host * size
    return HostLayout(size, host, leader, tuple(range(leader + 1, min(leader + size, world))))


def write_shares(files_per: str | None, host_size: int | None, rank_bytes: list[int]
                 ) -> list[Fraction | None]:
    """Each rank's part of the bytes its host writes in a save (``Storage.for_waited_writes``),
    from every rank's planned bytes: the host is a block of ``host_size`` ranks, else
    ``BCP_COMM_HOST_SIZE``, else ``LOCAL_WORLD_SIZE``, else the whole world (which can only
    make a part smaller). None for every rank in host mode (the leader writes the host's
    files) or with a bad setting (the save reports it), and for a host with nothing to write."""
    world = len(rank_bytes)
    if _files_mode(files_per) != "rank":
        return [None] * world
    try:
        size = host_size_setting(host_size)
    except ValueError:
        return [None] * world
    size = max(1, min(world, size)) if size else max(1, world)
    # each host's total once: a save of many ranks with no host size is one host of them all
    hosts = [sum(rank_bytes[first:first + size]) for first in range(0, world, size)]
    return [Fraction(mine, hosts[rank // size]) if hosts[rank // size] > 0 else None
            for rank, mine in enumerate(rank_bytes)]


# -- a member ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    entries: tuple[Entry, ...] = ()
    block: int = 0  # the largest block the member sends
    error: str | None = None  # the member failed before sending anything


def _as_tensor(data: memoryview) -> torch.Tensor:
    if data.readonly:  # packed objects (bytes): small, a copy is cheap
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)


def send_to_leader(comm: Communicator, layout: HostLayout, pairs: list[tuple[Entry, Source]],
                   error: BaseException | None, chunk_bytes: int) -> RankWrite:
    """A member's write: stream its entries to the host leader. Raises this rank's error
    (after telling the leader, so the leader never waits for bytes that will not come)."""
    if error is not None:
        comm.send_object(Manifest(error=Outcome.failure(error).error), layout.leader)
        raise error
    block = transfer_block(chunk_bytes, TRANSFER_BYTES)
    comm.send_object(Manifest(tuple(e for e, _ in pairs), block), layout.leader)
    status = torch.zeros(1, dtype=torch.int64)
    sent = 0
    with span("save.host_send", leader=layout.leader) as sp:
        for entry, source in pairs:
            try:
                data = memoryview(source()).cast("B")
                if len(data) != entry.nbytes:
                    raise RuntimeError(f"{entry.name}: produced {len(data)} bytes, planned {entry.nbytes}")
            except BaseException as exc:
                status[0] = 0
                comm.send_tensor(status, layout.leader, MEMBER_WAIT)
                comm.send_object(Outcome.failure(exc).error, layout.leader)  # for the leader's error
                raise
            status[0] = 1
            comm.send_tensor(status, layout.leader, MEMBER_WAIT)
            for start in range(0, len(data), block):
                comm.send_tensor(_as_tensor(data[start : start + block]), layout.leader, MEMBER_WAIT)
            sent += len(data)
        sp.set(bytes=sent)
    return RankWrite([], [], [], box_columns([]))


# -- the leader ------------------------------------------------------------------------------------


class _MemberStream:
    """The leader's end of one member's stream, received entry by entry in send order."""

    def __init__(self, comm: Communicator, rank: int, manifest: Manifest, buffer: torch.Tensor) -> None:
        self.comm, self.rank, self.manifest, self.buffer = comm, rank, manifest, buffer
        self.next = 0  # index of the entry being (or next to be) received
        self.left: int | None = None  # its bytes still to come; None: its status is not read yet
        self.ended = manifest.error is not None  # the member sends nothing more
        self.error = manifest.error

    def _open(self) -> bool:
        """Read the status of entry ``next``; False when the member gave up there."""
        status = torch.zeros(1, dtype=torch.int64)
        self.comm.recv_tensor(status, self.rank)
        if int(status.item()) != 1:
            self.ended = True
            self.error = str(self.comm.recv_object(self.rank))
            return False
        self.left = self.manifest.entries[self.next].nbytes
        self._close_if_done()
        return True

    def _close_if_done(self) -> None:
        if self.left == 0:
            self.next, self.left = self.next + 1, None

    def _block(self) -> memoryview:
        assert self.left is not None
        n = min(self.manifest.block, self.left)
        view = self.buffer[:n]
        self.comm.recv_tensor(view, self.rank)
        self.left -= n
        self._close_if_done()
        return memoryview(view.numpy())

    def parts(self, index: int) -> Iterator[memoryview]:
        """Entry ``index``'s bytes, block by block (each valid until the next is received)."""
        if index != self.next or self.left is not None or self.ended:
            raise RuntimeError(f"host files: rank {self.rank}'s entry {index} requested out of order")
        if not self._open():
            assert self.error is not None
            name = self.manifest.entries[index].name
            raise RankFailedError(f"rank {self.rank} could not send {name} to its host leader: "
                                  f"{self.error}", {self.rank: self.error})
        while self.next == index and self.left is not None:
            yield self._block()

    def drain(self) -> None:
        """Receive and drop whatever the member still sends (after a failure here)."""
        while not self.ended and self.next < len(self.manifest.entries):
            if self.left is None:
                if not self._open():
                    break
            else:
                self._block()


def receive_and_write(comm: Communicator, layout: HostLayout, storage: Storage, staging: str,
                      pairs: list[tuple[Entry, Source]], error: BaseException | None,
                      chunk_bytes: int, file_tag: str = "") -> RankWrite:
    """The leader's write: one file per kind holding its own entries, then each member's."""
    manifests = [comm.recv_object(m) for m in layout.members]  # always first: members wait on it
    blocks = [m.block for m in manifests if m.error is None and any(e.nbytes for e in m.entries)]
    buffer = torch.empty(max(blocks, default=0), dtype=torch.uint8)
    streams = [_MemberStream(comm, r, m, buffer) for r, m in zip(layout.members, manifests)]
    try:
        if error is not None:
            raise error
        failed = {s.rank: s.error for s in streams if s.error is not None}
        if failed:
            lines = "\n".join(f"  rank {r}: {msg}" for r, msg in sorted(failed.items()))
            raise RankFailedError(f"host {layout.host}: rank(s) failed before sending their pieces "
                                  f"to the host leader:\n{lines}", failed)
        return _write_host(layout, storage, staging, pairs, streams, comm.rank, chunk_bytes, file_tag)
    finally:
        for s in streams:
            s.drain()


def _write_host(layout: HostLayout, storage: Storage, staging: str, pairs: list[tuple[Entry, Source]],
                streams: list[_MemberStream], rank: int, chunk_bytes: int, file_tag: str) -> RankWrite:
    by_kind = pieces_by_kind(pairs)
    for s in streams:
        kinds = [KIND_ORDER.index(e.kind) for e in s.manifest.entries]
        if kinds != sorted(kinds):  # the leader consumes a member's stream kind by kind
            raise RuntimeError(f"host files: rank {s.rank} sent its entries out of kind order")
        for i, e in enumerate(s.manifest.entries):
            piece = Piece(e.name, e.code, e.shape, e.nbytes, None, parts=lambda _block, s=s, i=i: s.parts(i))
            by_kind[e.kind].append((e, piece))
    ranks = f"{layout.leader}-{layout.leader + len(layout.members)}"
    files: list[FileMeta] = []
    boxes: list[tuple[str, Box, ByteMeta]] = []
    objects: list[ObjectMeta] = []
    # One kind after another: members' streams are read in the order they were sent.
    for kind in (k for k in KIND_ORDER if by_kind[k]):
        fname = layout.file_name(kind, file_tag)
        entries = by_kind[kind]
        fmeta, written = write_kind_file(storage, staging, fname, kind, [p for _, p in entries], chunk_bytes,
                                         {"host": str(layout.host), "ranks": ranks}, rank, host=layout.host)
        files.append(fmeta)
        record([e for e, _ in entries], fname, written, boxes, objects)
    return RankWrite(files, boxes, objects, box_columns(boxes))


def write_host(comm: Communicator, layout: HostLayout, storage: Storage, staging: str,
               pairs: list[tuple[Entry, Source]], error: BaseException | None, chunk_bytes: int,
               file_tag: str = "") -> RankWrite:
    """This rank's part of a host-files save: the leader writes, members stream to it;
    ``file_tag`` goes into the file names (``commit.data_file_tag``)."""
    if comm.rank == layout.leader:
        return receive_and_write(comm, layout, storage, staging, pairs, error, chunk_bytes, file_tag)
    return send_to_leader(comm, layout, pairs, error, chunk_bytes)
