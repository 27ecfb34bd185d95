"""Errors raised by bytecheckpoint.

Every error names the problem and, where there is one, what to do about it.
They share one base class so callers can catch everything from the library at once.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by bytecheckpoint."""


class NotACheckpointError(CheckpointError):
    """The path holds no committed checkpoint (missing, never committed, or not ours)."""


class CheckpointExistsError(CheckpointError):
    """A committed checkpoint already exists at the target path."""


class CorruptCheckpointError(CheckpointError):
    """Checkpoint bytes or metadata are damaged: checksum mismatch, truncation, bad fields."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """Metadata points outside the checkpoint directory or carries forbidden values."""


class NewerFormatError(CorruptCheckpointError):
    """The checkpoint is of a format newer than this release reads: it is not damaged, upgrade
    bytecheckpoint to read it (a ``CorruptCheckpointError`` for callers that catch those)."""


class StateMismatchError(CheckpointError):
    """The state to load into does not match the checkpoint (keys, shapes or dtypes)."""


class MissingKeysError(StateMismatchError):
    """Keys are missing from the checkpoint, or the checkpoint has keys the state lacks."""

    def __init__(self, message: str, missing: list[str], unexpected: list[str]) -> None:
        super().__init__(message)
        self.missing_keys = missing
        self.unexpected_keys = unexpected


class ShapeMismatchError(StateMismatchError):
    """A tensor's global shape differs between the checkpoint and the state."""


class DtypeMismatchError(StateMismatchError):
    """A tensor's dtype differs between the checkpoint and the state."""


class PlanningError(CheckpointError):
    """The ranks' local plans do not form a valid global plan."""


class UnsupportedStateError(CheckpointError):
    """The state holds something the chosen framework planner cannot save or load."""


class StagingError(CheckpointError):
    """A save could not copy its tensors into host memory (no memory for the staging arena,
    or a failed device copy); nothing of that save was committed."""


class SnapshotChangedError(StagingError):
    """A saved tensor was changed in place before an overlapped async save had copied it
    (``snapshot="overlapped"``); nothing of that save was committed."""


class RankFailedError(CheckpointError):
    """One or more ranks failed; the message carries each failing rank's error."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


class ProcessGroupError(RankFailedError):
    """The process group itself failed in a checkpoint's collective: a rank crashed, was
    killed or lost its connection, or did not answer within the group's timeout. The group
    cannot carry another collective; restart the job from the last committed checkpoint."""

    def __init__(self, message: str) -> None:
        super().__init__(message, {})


class StorageError(CheckpointError):
    """A storage backend operation failed."""


class ColdTierUnavailableError(StorageError):
    """A cooled checkpoint's files link into a cold tier that is not there now (its disk is
    unmounted, or the cold root was moved). The checkpoint is committed and intact; its bytes
    are unreachable until the cold tier is mounted again where the links point. ``missing`` is
    the first cold path found missing."""

    def __init__(self, message: str, *, missing: str | None = None) -> None:
        super().__init__(message)
        self.missing = missing


class TransientStorageError(StorageError):
    """A storage operation failed in a way that may succeed on retry (network, throttling).
    ``server_busy``: the server asked for fewer requests (S3's SlowDown, a 503), so retries wait
    longer."""

    server_busy: bool = False


class StorageTimeoutError(TransientStorageError):
    """A storage server did not accept a connection, or did not answer a request, within the
    configured timeout (a hung server, a black-holed address); the message names the server,
    the timeout and the setting that sets it. Retried like any transient failure."""


class PermanentStorageError(StorageError):
    """A storage operation failed in a way no retry will fix (no bucket, no permission)."""


class StorageIOError(PermanentStorageError, OSError):
    """A storage operation failed with an operating-system error no retry fixes (a full disk, a
    read-only file system, no permission). Names the operation and the path; keeps ``errno``,
    and is an ``OSError`` too, so code that catches those still does."""

    def __init__(self, message: str, *, op: str, path: str, errno: int | None = None) -> None:
        if errno is None:
            OSError.__init__(self, message)
        else:
            OSError.__init__(self, errno, message)
        self.message, self.op, self.path = message, op, path

    def __str__(self) -> str:
        return self.message


class NotARegularFileError(StorageIOError):
    """Where a storage file should be, there is something else (a FIFO, a socket, a device):
    refused without opening it, since opening a FIFO would wait for a writer forever."""


class InvalidStorageURLError(PermanentStorageError):
    """A storage URL that cannot name anything (``s3://`` without a bucket): a usage error."""


class InvalidArgumentError(CheckpointError, ValueError):
    """An argument of a public call is not valid (a ``step`` that is not a whole number >= 0,
    say); nothing was written."""


class InvalidSettingError(InvalidArgumentError):
    """An environment variable (``BCP_*``) holds a value it cannot take; the message names the
    variable, the value and what it may be. Nothing was read or written."""


class InvalidStorageSettingError(InvalidSettingError, StorageError):
    """A storage setting (a ``BCP_STORAGE_*`` variable or the ``BCP_STORAGE_CONFIG`` file) is not
    valid; a ``StorageError`` too, for callers that catch those."""


class ConcurrentSaveError(CheckpointError):
    """Another save to the same checkpoint path is in progress (or another checkpoint-replacing
    operation holds it); nothing of the other save was touched."""


class DataLoaderError(CheckpointError, RuntimeError):
    """A ``TokenLoader`` reader process died, failed, or made no progress for
    ``reader_timeout_s`` while a batch waited on it; the loader stops (close it, then resume
    from the last checkpoint)."""


class CheckpointReplacedError(CheckpointError):
    """The checkpoint was replaced (an ``overwrite=True`` save, or ``latest`` moved) while it was
    being loaded, so the bytes read may mix two saves; loading again reads the new one."""
