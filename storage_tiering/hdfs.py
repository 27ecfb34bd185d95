"""HDFS mode: the same policy, carried out by HDFS storage policies, so the path never changes.

Cooling a checkpoint on HDFS is:

1. journal  a marker ``.<name>.tiering-<id>`` next to the checkpoint (JSON: the steps done),
            rewritten atomically (write, then rename over) at each step;
2. policy   set the directory's storage policy to ``cold_policy`` (``COLD``: ARCHIVE disks),
            a name-node metadata change; the path and the files stay as they are;
3. migrate  run the HDFS Mover on the directory, which moves each block to a datanode
            storage of the new type (readers fetch block locations from the name node, so a
            read in progress goes on);
4. verify   read every file back through the storage layer and check the checkpoint's
            checksums; then delete the marker.

A marker left by a crash means the move was interrupted: the next pass runs the Mover and the
verification again (both are idempotent), then removes it. The state of a checkpoint is its
directory's storage policy.

``hdfs-native`` (the client the storage layer uses) has no storage-policy calls, so the
policy and the Mover go through the Hadoop command line (``hdfs storagepolicies``,
``hdfs mover``), as an operator would run them: :class:`HdfsCli`. No cluster runs here; the
tests drive this module with the in-memory HDFS stand-in and a recording admin.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from bytecheckpoint.format.metadata import METADATA_FILE, CheckpointMetadata
from bytecheckpoint.manage.catalog import Catalog, CheckpointInfo
from bytecheckpoint.storage import Storage
from telemetry import span

from .mover import MoveError, MoveResult
from .verify import chunk_checks, digest

MARKER_TAG = ".tiering-"


class PolicyAdmin(Protocol):
    """What HDFS mode needs beyond the file interface (all paths are full ``hdfs://`` URLs)."""

    def get_policy(self, url: str) -> str: ...

    def set_policy(self, url: str, policy: str) -> None: ...

    def migrate(self, url: str) -> None:
        """Move the blocks under ``url`` to the storage types of its policy; return when done."""


class HdfsCli:
    """The Hadoop command line: ``hdfs storagepolicies`` and ``hdfs mover``."""

    def __init__(self, binary: str | None = None,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                 timeout_s: float = 6 * 3600) -> None:
        self.binary = binary or os.environ.get("BCP_TIERING_HDFS_CLI", "hdfs")
        self._run, self.timeout_s = run, timeout_s

    def _call(self, *args: str) -> str:
        cmd = [self.binary, *args]
        try:
            proc = self._run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
        except FileNotFoundError:
            raise MoveError(f"the Hadoop command line {self.binary!r} is not on PATH: install a Hadoop "
                            "client, or name it with BCP_TIERING_HDFS_CLI") from None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
            raise MoveError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {' | '.join(tail)}")
        return proc.stdout

    def get_policy(self, url: str) -> str:
        out = self._call("storagepolicies", "-getStoragePolicy", "-path", url)
        m = re.search(r"BlockStoragePolicy\{(\w+):", out)
        return m.group(1) if m else "unspecified"

    def set_policy(self, url: str, policy: str) -> None:
        self._call("storagepolicies", "-setStoragePolicy", "-path", url, "-policy", policy)

    def migrate(self, url: str) -> None:
        self._call("mover", "-p", url)


def _read_meta(storage: Storage, path: str) -> CheckpointMetadata:
    meta_path = posixpath.join(path, METADATA_FILE)
    return CheckpointMetadata.from_bytes(bytes(storage.read(meta_path)), source=storage.url(meta_path))


def scan_remote(storage: Storage, root: str, admin: PolicyAdmin, cold_policy: str) -> list[CheckpointInfo]:
    """The checkpoints under ``root`` on a storage without local links (HDFS), from the core's
    catalog; a committed one is cold when its storage policy is the cold one and no move of it
    is under way. Their age is their commit time as the metadata records it."""
    out = []
    for c in Catalog(storage, root).scan():
        cold = (c.committed and admin.get_policy(storage.url(c.path)) == cold_policy
                and not _markers(storage, c.path))
        out.append(replace(c, cold_files=len(c.files)) if cold else c)
    return out


def _markers(storage: Storage, path: str) -> list[str]:
    parent, name = posixpath.split(path)
    prefix = f".{name}{MARKER_TAG}"
    return [posixpath.join(parent, e) for e in storage.list_dir(parent) if e.startswith(prefix)]


class HdfsMover:
    def __init__(self, storage: Storage, admin: PolicyAdmin, cold_policy: str,
                 on_step: Callable[[str], None] | None = None) -> None:
        self.storage, self.admin, self.cold_policy = storage, admin, cold_policy
        self.on_step = on_step or (lambda step: None)

    def _mark(self, marker: str, doc: dict) -> None:
        tmp = f"{marker}.tmp"
        self.storage.write_bytes(tmp, json.dumps(doc).encode())
        self.storage.rename(tmp, marker, overwrite=True)

    def cool(self, ckpt: CheckpointInfo, marker: str | None = None) -> MoveResult:
        t0 = time.perf_counter()
        url = self.storage.url(ckpt.path)
        parent, name = posixpath.split(ckpt.path)
        marker = marker or posixpath.join(parent, f".{name}{MARKER_TAG}{uuid.uuid4().hex[:12]}")
        with span("tiering.move", checkpoint=url, path=url, files=len(ckpt.files),
                  policy=self.cold_policy) as ev:
            self._mark(marker, {"checkpoint": ckpt.path, "policy": self.cold_policy, "state": "begin"})
            self.admin.set_policy(url, self.cold_policy)
            self._mark(marker, {"checkpoint": ckpt.path, "policy": self.cold_policy, "state": "policy"})
            self.on_step("policy")
            self.admin.migrate(url)
            self._mark(marker, {"checkpoint": ckpt.path, "policy": self.cold_policy, "state": "migrated"})
            self.on_step("migrated")
            size = self._verify(ckpt.path)
            self.storage.delete(marker)
            ev.set(bytes=size)
        return MoveResult(url, len(ckpt.files), size, time.perf_counter() - t0)

    def _verify(self, path: str) -> int:
        meta = _read_meta(self.storage, path)
        total = 0
        for f in meta.files:
            full = posixpath.join(path, f.name)
            size = self.storage.size(full)
            checks = chunk_checks(meta, f.name)
            got = digest(lambda off, n, p=full: self.storage.read(p, off, n), size, checks)
            if size != f.size or got.bad:
                raise MoveError(f"{self.storage.url(full)}: fails the checkpoint's checksums after the HDFS "
                                f"Mover ({size} of {f.size} bytes, bad: {list(got.bad[:3])})")
            total += size
        return total

    def recover(self, checkpoints: Sequence[CheckpointInfo]) -> int:
        """Finish every move a marker says was interrupted (the steps are idempotent)."""
        done = 0
        for c in checkpoints:
            for marker in _markers(self.storage, c.path):
                if marker.endswith(".tmp"):
                    self.storage.delete(marker)
                    continue
                with span("tiering.recover", checkpoint=self.storage.url(c.path)):
                    self.cool(c, marker)
                done += 1
        return done
