"""Reading a metadata file off storage, bounded: a hostile size is refused before allocating."""

from __future__ import annotations

import os

from ..errors import CorruptCheckpointError, InvalidSettingError
from ..storage import Storage

METADATA_MAX_ENV = "BCP_METADATA_MAX_BYTES"
DEFAULT_METADATA_MAX_BYTES = 1 << 30
_METADATA_READ_CHUNK = 64 << 20


def metadata_max_bytes() -> int:
    """``BCP_METADATA_MAX_BYTES``: the largest metadata file a reader accepts (default 1 GiB,
    several times what ten million boxes take)."""
    raw = os.environ.get(METADATA_MAX_ENV, "").strip()
    try:
        value = int(raw) if raw else DEFAULT_METADATA_MAX_BYTES
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidSettingError(f"{METADATA_MAX_ENV} = {raw!r} is not a positive whole number of "
                                  f"bytes; unset it or give one (default {DEFAULT_METADATA_MAX_BYTES})")
    return value


def read_metadata_bytes(storage: Storage, meta_path: str, size: int | None = None) -> bytes:
    """The metadata file's bytes, refused above ``metadata_max_bytes()`` before anything is
    allocated, and read in bounded chunks (a file that changes size meanwhile is an error).
    ``size``: the file's size where the caller just asked it (a listing), saving a request."""
    if size is None:
        try:
            size = storage.size(meta_path)
        except (IsADirectoryError, NotADirectoryError):
            # Its name is there, so this is no "not a checkpoint": something replaced the file.
            raise CorruptCheckpointError(
                f"{storage.url(meta_path)}: the metadata file is a directory (or lies under a file), "
                "not a file; the checkpoint is damaged: restore it from a copy, or load another") from None
    limit = metadata_max_bytes()
    if size > limit:
        raise CorruptCheckpointError(
            f"{storage.url(meta_path)}: the metadata file is {size} bytes, over the limit of {limit} "
            f"({METADATA_MAX_ENV}); the checkpoint is damaged or hostile, or raise the limit"
        )
    # One byte more than the size: a file that grew (was replaced) since its size was asked
    # fills it, instead of being read cut short.
    buf = bytearray(size + 1)
    view = memoryview(buf)
    for start in range(0, size + 1, _METADATA_READ_CHUNK):
        end = min(size + 1, start + _METADATA_READ_CHUNK)
        got = storage.read_into(meta_path, start, view[start:end])
        if got != min(end, size) - start:
            change = "grew" if start + got > size else "shrank"
            raise CorruptCheckpointError(f"{storage.url(meta_path)}: the metadata file {change} while "
                                         "it was read; retry, or check what else writes there")
    return bytes(view[:size])
