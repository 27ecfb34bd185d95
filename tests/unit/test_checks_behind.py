"""Checksums are verified behind the reads (``load_pipeline.ChecksBehind``): a reader thread
starts its next request while the bytes it just read are hashed on a thread of their own,
yet a corrupt byte is still refused by name and no check outlives its load (issue 21)."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bytecheckpoint.engine import load_pipeline
from bytecheckpoint.engine.load_pipeline import BoxRead, Prefetch, settle
from bytecheckpoint.errors import CorruptCheckpointError
from bytecheckpoint.format.boxes import Box
from bytecheckpoint.format.checksums import chunk_checksums
from bytecheckpoint.storage.local import LocalStorage

CHUNK = 4096


def _file(tmp_path, sizes: list[int], seed: int) -> tuple[str, list[bytes]]:
    """One file of pieces back to back; their bytes."""
    g = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes() for n in sizes]
    with open(tmp_path / "data", "wb") as f:
        for p in pieces:
            f.write(p)
    return str(tmp_path), pieces


def _reads(pieces: list[bytes]) -> dict[tuple[int, int], BoxRead]:
    """A read of each whole piece straight into a zeroed target."""
    out, offset = {}, 0
    for i, p in enumerate(pieces):
        read = BoxRead(f"t{i}", "data", offset, len(p), 0, len(p),
                       tuple(chunk_checksums(memoryview(p), CHUNK)), box=Box((0,), (len(p),)))
        read.direct = torch.zeros(len(p), dtype=torch.uint8)
        out[(0, offset)] = read
        offset += len(p)
    return out


def _prefetch(path: str, reads: dict, run_bytes: int) -> Prefetch:
    return Prefetch(LocalStorage(fsync=False), path, reads, sorted(reads), verify=True,
                    chunk_bytes=CHUNK, run_bytes=run_bytes)


def test_the_reader_starts_its_next_request_while_the_last_one_is_hashed(tmp_path, monkeypatch):
    path, pieces = _file(tmp_path, [3 * CHUNK, 2 * CHUNK + 5], seed=0)
    reads = _reads(pieces)
    second_read_began = threading.Event()
    seen: list[bool] = []
    real_read_spans, real_bad_chunks = load_pipeline.read_spans, load_pipeline.bad_chunks

    def read_spans(storage, full, spans):
        if spans[0][0] > 0:  # the second piece's request
            second_read_began.set()
        return real_read_spans(storage, full, spans)

    def bad_chunks(view, first_byte, expected, chunk_bytes):
        if not seen:  # the first piece's hash waits for the reader to move on
            seen.append(second_read_began.wait(timeout=10))
        return real_bad_chunks(view, first_byte, expected, chunk_bytes)

    monkeypatch.setattr(load_pipeline, "read_spans", read_spans)
    monkeypatch.setattr(load_pipeline, "bad_chunks", bad_chunks)
    prefetch = _prefetch(path, reads, run_bytes=3 * CHUNK)  # one request per piece
    try:
        for key in sorted(reads):
            settle(prefetch.futures[key])
    finally:
        prefetch.close()
    assert seen == [True]  # hashed in line, the second request could not begin before it
    for read, p in zip(reads.values(), pieces):
        assert read.direct.numpy().tobytes() == p


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 3 * CHUNK + 7), min_size=1, max_size=6),
       victim=st.integers(0, 5), at=st.floats(0, 0.999), run_chunks=st.integers(1, 8),
       seed=st.integers(0, 3))
def test_a_flipped_byte_anywhere_is_refused_by_name_and_the_rest_load_exact(
        tmp_path_factory, sizes, victim, at, run_chunks, seed):
    tmp = tmp_path_factory.mktemp("behind")
    path, pieces = _file(tmp, sizes, seed)
    victim %= len(pieces)
    offset = sum(len(p) for p in pieces[:victim]) + int(at * len(pieces[victim]))
    with open(os.path.join(path, "data"), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    reads = _reads(pieces)
    prefetch = _prefetch(path, reads, run_bytes=run_chunks * CHUNK)
    outcomes = {}
    try:
        for key, read in reads.items():
            try:
                settle(prefetch.futures[key])
                outcomes[read.key] = "ok"
            except CorruptCheckpointError as exc:
                outcomes[read.key] = str(exc)
    finally:
        prefetch.close()
    for i, (read, p) in enumerate(zip(reads.values(), pieces)):
        if i == victim:
            assert "checksum mismatch" in outcomes[read.key] and read.key in outcomes[read.key]
        elif outcomes[read.key] != "ok":  # refused only with a run that holds the victim
            assert f"t{victim}" in outcomes[read.key]
        else:
            assert read.direct.numpy().tobytes() == p


def test_close_waits_for_every_check(tmp_path, monkeypatch):
    path, pieces = _file(tmp_path, [CHUNK] * 4, seed=1)
    reads = _reads(pieces)
    running, finished = threading.Event(), []
    real = load_pipeline.bad_chunks

    def slow(view, first_byte, expected, chunk_bytes):
        running.set()
        threading.Event().wait(0.2)
        finished.append(first_byte)
        return real(view, first_byte, expected, chunk_bytes)

    monkeypatch.setattr(load_pipeline, "bad_chunks", slow)
    prefetch = _prefetch(path, reads, run_bytes=CHUNK)
    assert running.wait(timeout=10)
    prefetch.close()
    # Every read that ran has been checked by the time close returns; none was left hashing.
    ran = [k for k, f in prefetch.futures.items() if not f.cancelled()]
    assert len(finished) == len(ran) >= 1
    for key in ran:
        settle(prefetch.futures[key])  # done: returns at once


def test_without_verification_nothing_is_hashed(tmp_path, monkeypatch):
    path, pieces = _file(tmp_path, [2 * CHUNK, CHUNK + 1], seed=2)
    reads = _reads(pieces)
    monkeypatch.setattr(load_pipeline, "bad_chunks", lambda *a: pytest.fail("hashed"))
    prefetch = Prefetch(LocalStorage(fsync=False), path, reads, sorted(reads), verify=False,
                        chunk_bytes=CHUNK)
    try:
        for key in sorted(reads):
            settle(prefetch.futures[key])
    finally:
        prefetch.close()
    for read, p in zip(reads.values(), pieces):
        assert read.direct.numpy().tobytes() == p
