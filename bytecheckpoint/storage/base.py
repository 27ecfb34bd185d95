"""The storage interface the engine is written against.

A backend supplies a handful of primitives on paths within its own namespace (strings with
``/`` separators, no scheme): a streaming writer, ranged reads, size, listing, rename,
delete. The engine never touches a file system directly, so a new backend is one module.
"""

from __future__ import annotations

import abc
import enum
import logging
import posixpath
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, ClassVar

from ..errors import NotARegularFileError

# The commit marker's name (``format.metadata.METADATA_FILE``, which the format layer owns):
# backends that upload a file in parts as it is written send this one in a single request.
COMMIT_MARKER_NAME = "metadata.msgpack"

log = logging.getLogger("bytecheckpoint.storage")


class CommitMode(str, enum.Enum):
    """How a checkpoint becomes visible.

    RENAME: files are written into a staging directory that is renamed to the final path
    (atomic on POSIX file systems and in memory). MARKER: files are written in place and the
    metadata file, written last, is the commit marker (object stores have no rename).
    """

    RENAME = "rename"
    MARKER = "marker"


class Writer(abc.ABC):
    """A file being written. Bytes become durable only after :meth:`commit`."""

    # What a write must look like to go to the disk straight from the caller's memory
    # (``direct_io.Alignment``: a buffer whose address is congruent to its file offset), or None
    # where every write is copied; ``direct_bytes`` counts the bytes written so.
    direct_alignment: Any = None
    direct_bytes: int = 0
    # Seconds this file waited for a host write slot (``write_slots``) before its bulk went out.
    slot_wait_s: float = 0.0

    @abc.abstractmethod
    def write(self, data: memoryview | bytes) -> None: ...

    @abc.abstractmethod
    def commit(self) -> int:
        """Flush, make durable, close; return the file size."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Close and discard what was written."""


class WrappedWriter(Writer):
    """A writer around another (``_inner``) that reports the inner one's direct writes: what a
    wrapper adds (faults, retries, events) never changes where the bytes go."""

    _inner: Writer

    @property
    def direct_alignment(self) -> Any:  # type: ignore[override]
        return self._inner.direct_alignment

    @property
    def direct_bytes(self) -> int:  # type: ignore[override]
        return self._inner.direct_bytes

    @property
    def slot_wait_s(self) -> float:  # type: ignore[override]
        return self._inner.slot_wait_s


def abort_quietly(writer: Writer) -> None:
    """Abort ``writer`` after a failure without hiding that failure behind the abort's own."""
    try:
        writer.abort()
    except Exception as exc:  # noqa: BLE001 - the original error is the one to report
        log.warning("could not discard a partly written file: %s", exc)


class Storage(abc.ABC):
    scheme: ClassVar[str]
    commit_mode: ClassVar[CommitMode] = CommitMode.RENAME
    # True where a writer's write() returns once the bytes are copied into memory that is
    # written back later (a page cache), never waiting on a network: an overlapped save may
    # then write straight from live tensors (engine.write_through).
    buffered_writes: ClassVar[bool] = False

    @abc.abstractmethod
    def open_writer(self, path: str) -> Writer: ...

    @abc.abstractmethod
    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from ``path`` starting at ``offset``; return bytes read."""

    def read_into_many(self, path: str, offset: int, buffers: list[memoryview]) -> int:
        """Fill ``buffers`` in order from one contiguous range of ``path`` starting at
        ``offset`` (a vectored read); return the bytes read, short only at end of file.
        Backends that can read a range in one request override this."""
        total = 0
        for buffer in buffers:
            want = len(memoryview(buffer).cast("B"))
            got = self.read_into(path, offset + total, buffer)
            total += got
            if got < want:
                break
        return total

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes; raises FileNotFoundError if ``path`` is not a file."""

    @abc.abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names directly under ``path`` (empty if it does not exist)."""

    @abc.abstractmethod
    def is_dir(self, path: str) -> bool: ...

    @abc.abstractmethod
    def makedirs(self, path: str) -> None: ...

    @abc.abstractmethod
    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        """Atomically move a file or directory. ``dst`` must not exist unless ``overwrite``
        (files only), in which case it is replaced atomically."""

    def exchange(self, a: str, b: str) -> bool:
        """Swap the entries ``a`` and ``b`` in one step, so that each path always names one of
        the two; False (nothing changed) where the backend cannot, and the caller renames in
        two steps."""
        return False

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Remove a file or a directory tree; a missing path is not an error."""

    def check_path(self, path: str) -> None:
        """Raise :class:`~bytecheckpoint.errors.InvalidStorageURLError` when ``path`` cannot name
        anything on this backend (an S3 path without a bucket); called when a URL is opened, so
        a malformed one fails at once instead of being retried."""

    def for_waited_writes(self, share_of_host: Fraction | None = None) -> Storage:
        """This storage tuned for writes a caller waits for (a synchronous save), where only
        the wall time counts: a local disk writes through the page cache unless
        ``BCP_STORAGE_DIRECT_WRITES=1`` and at most ``BCP_STORAGE_HOST_WRITERS`` large files at
        once per host. ``share_of_host``, where known, is the part of the host's bytes this
        process writes; its files then hold at most that part of the host's slots (at least
        one). Backends with nothing to tune return themselves."""
        return self

    # -- derived -----------------------------------------------------------------
    def exists(self, path: str) -> bool:
        try:
            self.size(path)
            return True
        except NotARegularFileError:
            return True  # something is there, just not a file
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            # NotADirectoryError: a path below a regular file (``file/metadata.msgpack``) is not there
            return self.is_dir(path)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytearray:
        if length is None:
            length = self.size(path) - offset
        buf = bytearray(length)
        got = self.read_into(path, offset, memoryview(buf))
        if got != length:
            raise EOFError(f"{self.url(path)}: wanted {length} bytes at {offset}, got {got}")
        return buf

    def read_small(self, path: str, max_bytes: int) -> bytes | None:
        """The whole of a small file that a writer may replace (rename over) at any moment, in
        one request, never a size and then a read that could see two different files; None
        when it holds more than ``max_bytes``."""
        buf = bytearray(max_bytes + 1)
        got = self.read_into(path, 0, memoryview(buf))
        return None if got > max_bytes else bytes(buf[:got])

    def write_bytes(self, path: str, data: bytes) -> int:
        writer = self.open_writer(path)
        try:
            writer.write(data)
        except BaseException:
            abort_quietly(writer)
            raise
        return writer.commit()

    def write_chunks(self, path: str, chunks: Sequence[memoryview | bytes]) -> int:
        writer = self.open_writer(path)
        try:
            for chunk in chunks:
                writer.write(chunk)
        except BaseException:
            abort_quietly(writer)
            raise
        return writer.commit()

    @staticmethod
    def join(*parts: str) -> str:
        return posixpath.join(*parts)

    def url(self, path: str) -> str:
        return f"{self.scheme}://{path}"
