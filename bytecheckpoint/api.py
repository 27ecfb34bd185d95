"""The public entry points: ``save`` and ``load``.

``state`` is a dict such as ``{"model": model, "optimizer": optim, "extra_state": {...}}``.
Modules and optimizers are saved tensor by tensor in a layout-free form; anything else with
``state_dict()``/``load_state_dict()`` (or a plain value) is packed per rank.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

from .engine.async_save import SaveHandle, wait_pending
from .engine.load import LoadResult
from .engine.load import load as _load
from .engine.messages import SaveOptions
from .engine.save import SaveResult
from .engine.save import save as _save
from .engine.snapshot import snapshot_mode
from .engine.staging_ring import staging_cap
from .errors import InvalidArgumentError
from .format.checksums import DEFAULT_CHUNK_BYTES
from .manage.catalog import newer_than_latest
from .runtime.comm import Communicator, Outcome, raise_failures

MAX_STEP = 2**63 - 1  # what the metadata and the latest pointer store


def check_step(step: Any) -> int | None:
    """``step`` as a plain int (numpy and 0-d tensor integers converted), or None; anything
    else (a bool, a float, a string, a negative or huge number) is an InvalidArgumentError."""
    if step is None:
        return None
    if isinstance(step, bool) or type(step).__name__ in ("bool_", "bool"):
        value = None
    else:
        try:
            value = operator.index(step)
        except TypeError:
            value = None
    if value is None or not 0 <= value <= MAX_STEP:
        raise InvalidArgumentError(
            f"step={step!r} ({type(step).__name__}) is not a training step: give a whole number "
            f"from 0 to 2**63-1, or None; nothing was saved"
        )
    return int(value)


def save(
    path: str,
    state: dict[str, Any],
    *,
    framework: str | None = None,
    step: int | None = None,
    user_metadata: dict[str, Any] | None = None,
    process_group: Any = None,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    fqn_map: Callable[[str], str] | None = None,
    async_save: bool = False,
    files_per: str | None = None,
    host_size: int | None = None,
    snapshot: str = "blocking",
    staging_max_bytes: int | None = None,
) -> SaveResult | SaveHandle:
    """Save ``state`` to the checkpoint directory ``path``; every rank must call it.

    Args:
        path: a local path, ``file://``, ``mem://``, ``shm://``, ``s3://`` or ``hdfs://`` (see
            ``docs/storage.md``). The checkpoint appears there only once every rank
            has written its files (atomic commit); ``<parent>/latest`` then names it.
        framework: ``"ddp"``, ``"fsdp"`` (v1), ``"fsdp2"``, ``"dtensor"`` (TP, 2-D meshes),
            ``"manual"`` (``TensorShard`` / Megatron ``ShardedTensor`` dicts) or ``"single"``;
            ``None`` detects it.
        step: the training step (an int >= 0, or None), recorded in the metadata and the
            ``latest`` pointer, which names the checkpoint of the highest step saved in a root.
        user_metadata: small JSON-like values stored in the metadata.
        process_group: the ranks taking part (default: the default group, or none).
        overwrite: replace a committed checkpoint already at ``path`` (only that: anything
            else there, such as a file, a root of checkpoints or a directory holding other
            files, is refused with an error and left untouched).
        chunk_bytes: checksum granularity in bytes.
        fqn_map: renames this rank's parameter names to global ones, e.g. a pipeline stage's
            ``layers.0`` to ``layers.8`` (see :func:`bytecheckpoint.pipeline_fqn_map`).
        async_save: return a :class:`SaveHandle` as soon as this rank's share of the state is
            copied into host memory; writing and committing go on in the background, and the
            tensors may change meanwhile. ``handle.wait()`` returns the ``SaveResult`` or raises
            the save's error. The next save (or load) waits for this one first; call
            ``wait()`` before ``destroy_process_group()``.
        files_per: ``"rank"`` (default, or ``BCP_FILES_PER``): one storage file per rank and
            kind; ``"host"``: one per host and kind, written by the host's first rank from
            the bytes its other ranks send it (fewer files for the file system's metadata
            server; any backend). Must be the same on every rank.
        host_size: ranks per host for ``files_per="host"`` (default ``BCP_COMM_HOST_SIZE``,
            else ``LOCAL_WORLD_SIZE``); hosts are blocks of consecutive ranks.
        snapshot: for ``async_save=True``: ``"blocking"`` (the default; ``save`` returns once the
            tensors are copied) or ``"overlapped"``: ``save`` returns once the save is planned and
            the copy overlaps training; ``optimizer.step()`` and the forward of saved modules
            with buffers wait for it, any other in-place change of a saved tensor must call
            ``handle.wait_snapshot()`` first (docs/performance/training-loop.md, "Overlapped snapshot"). The
            save commits once training confirms the copy (its next step, forward or call on
            the handle), or after ``BCP_SNAPSHOT_CONFIRM_S`` seconds. CPU tensors saved to
            local disk are written straight from the live tensors, with no copy and no
            staging memory, and the step waits for that write instead
            (``BCP_SNAPSHOT_WRITE_THROUGH=0``: copy first).
        staging_max_bytes: the most host memory this rank stages the save into (async saves,
            device tensors; default ``BCP_STAGING_MAX_BYTES``, else one copy of the rank's
            share). Below the share the copy runs in rounds that wait for the writer, so an
            async save returns (blocking) or releases ``optimizer.step()`` (overlapped) only
            after about the write of all but the last round (docs/performance/training-loop.md,
            "Bounded staging arena").

    A save whose state structure is unchanged since this process group's last save reuses
    that save's plan and sends no planning messages (``SaveResult.cached_plan``).
    """
    cap = None if staging_max_bytes is None else staging_cap(staging_max_bytes)
    opts = SaveOptions(framework=framework, step=check_step(step), user_metadata=dict(user_metadata or {}),
                       process_group=process_group, overwrite=overwrite, chunk_bytes=chunk_bytes,
                       fqn_map=fqn_map, async_save=async_save, files_per=files_per, host_size=host_size,
                       snapshot=snapshot_mode(snapshot, async_save),
                       staging_max_bytes=cap)
    return _save(path, state, opts)


def load(
    path: str,
    state: dict[str, Any],
    *,
    framework: str | None = None,
    strict: bool = True,
    process_group: Any = None,
    verify: bool = True,
    fqn_map: Callable[[str], str] | None = None,
) -> LoadResult:
    """Load the checkpoint at ``path`` into ``state`` in place, resharding as needed.

    ``path`` is a checkpoint directory or a root whose ``latest`` pointer names one. With
    ``strict=False``, keys that only one side has are reported in the result instead of
    raising. ``verify`` checks the checksum of every byte read. ``fqn_map`` renames this
    rank's parameter names to global ones, as in :func:`save`. A checkpoint replaced by an
    ``overwrite=True`` save while it is loaded raises ``CheckpointReplacedError`` (load again).
    A load that raises, on any rank, may have filled part of ``state`` on every rank: load
    again (or rebuild the state) before using it.
    """
    wait_pending()  # a save still in flight finishes first (it may be the one to load)
    path = _past_lagging_latest(path, process_group)  # object stores: 'latest' may lag a racing save
    return _load(path, state, framework=framework, strict=strict, process_group=process_group,
                 verify=verify, fqn_map=fqn_map)


def _past_lagging_latest(path: str, process_group: Any) -> str:
    """``path``, or the newer checkpoint a load takes instead of the one a lagging ``latest``
    names (:func:`newer_than_latest`). That lists the root and reads every checkpoint's
    metadata, so in a process group the coordinator alone does it and broadcasts the answer
    (one small collective before the engine's, which every rank of a load calls): a resume of
    1,000 ranks reads the root once, not 1,000 times."""
    comm = Communicator(process_group)
    if not comm.distributed:
        return newer_than_latest(path) or path
    mine: Outcome | None = None
    error: BaseException | None = None
    if comm.is_coordinator:
        try:
            mine = Outcome(value=(path, newer_than_latest(path)))
        except BaseException as exc:  # told to the others, who wait in the broadcast
            error, mine = exc, Outcome.failure(exc)
    told = comm.broadcast(mine)
    raise_failures([told], "checkpoint load", error)
    asked, newer = told.value
    # A rank given another path loads it: the engine's identity check names the mismatch.
    return newer if newer is not None and asked == path else path


def pipeline_fqn_map(offset: int, prefix: str = "layers.") -> Callable[[str], str]:
    """Map a pipeline stage's local layer numbers to global ones: with ``offset=8``,
    ``layers.0.attn.weight`` becomes ``layers.8.attn.weight`` (also below a parent, as in
    ``decoder.layers.0``). Names without ``prefix`` stay as they are."""
    pattern = re.compile(rf"(^|\.){re.escape(prefix)}(\d+)(?=\.|$)")

    def rename(fqn: str) -> str:
        return pattern.sub(lambda m: f"{m.group(1)}{prefix}{int(m.group(2)) + offset}", fqn, count=1)

    return rename
