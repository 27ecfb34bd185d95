"""The root ``bcp ls`` and ``bcp gc`` work on: a local directory or any storage URL (``s3://``),
either a root of runs or one checkpoint, listed through the core's catalog
(:mod:`bytecheckpoint.manage.catalog`), so the command line sees checkpoints exactly as the
manager and the tiering service do."""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

from ..errors import NotACheckpointError
from ..format.metadata import METADATA_FILE, CheckpointMetadata
from ..manage.catalog import Catalog, describe, open_root
from ..manage.records import CheckpointInfo
from ..storage import Storage, split_url


@dataclass(frozen=True)
class Root:
    given: str  # as the user wrote it (absolute on local disk)
    storage: Storage
    path: str  # the directory scanned: ROOT, or its parent when ROOT is one checkpoint
    local: bool
    one: str | None = None  # the checkpoint's name when ROOT is one checkpoint

    def metadata(self, c: CheckpointInfo) -> CheckpointMetadata:
        meta_path = posixpath.join(c.path, METADATA_FILE)
        return CheckpointMetadata.from_bytes(bytes(self.storage.read(meta_path)),
                                             source=self.storage.url(meta_path))


def open_ls_root(url: str) -> Root:
    """ROOT as ``bcp ls``/``gc`` take it; a local path that is no directory is no root."""
    local = split_url(url)[0] == "file"
    storage, path = open_root(url)
    if local:
        if not os.path.isdir(path):
            what = "is not a directory" if os.path.lexists(path) else "no such directory"
            raise NotACheckpointError(f"{path}: {what} (bcp ls and gc take a directory of checkpoints, "
                                      "or a storage URL such as s3://bucket/prefix)")
        given = path
    else:
        path = path.rstrip("/")
        given = url
    meta = posixpath.join(path, METADATA_FILE)
    # A cooled checkpoint whose cold tier is not mounted: its metadata is a link to nothing.
    if storage.exists(meta) or (local and os.path.islink(meta)):
        parent, name = posixpath.split(path)
        return Root(given, storage, parent, local, name)
    return Root(given, storage, path, local)


def list_checkpoints(root: Root, cold_root: str | None) -> list[CheckpointInfo]:
    """Every checkpoint under ROOT (only it, when ROOT is one checkpoint)."""
    if root.one is not None and root.local:
        one = describe(posixpath.join(root.path, root.one), root.path, cold_root)
        return [one] if one is not None else []
    catalog = Catalog(root.storage, root.path, cold_root if root.local else None)
    if root.one is not None:
        return [c for c in catalog.scan(nested=False) if c.name == root.one]
    return catalog.scan()
