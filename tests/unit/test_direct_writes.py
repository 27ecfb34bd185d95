"""Direct writes (``storage.direct_io``, format version 4): the aligned middle of a large write to
a local file goes to the disk from the caller's memory with ``O_DIRECT``; its head and tail, and
anything misaligned, go through the page cache. Whatever the offsets and addresses, the file
holds exactly the bytes written, and a file that refuses direct writes gets them buffered."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bytecheckpoint as bcp
from bytecheckpoint.engine.files import Piece, write_file
from bytecheckpoint.format.file_headers import (
    DATA_ALIGN,
    DIRECT_PADDING,
    PADDING_PREFIX,
    header_problem,
    padding_limit,
)
from bytecheckpoint.storage import direct_io
from bytecheckpoint.storage.local import LocalStorage
from bytecheckpoint.storage.shm import SharedMemoryStorage

MiB = 1 << 20


def _direct_capable(directory: str) -> direct_io.Alignment:
    probe = os.path.join(directory, "probe")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        align = direct_io.alignment(fd)
    finally:
        os.close(fd)
        os.unlink(probe)
    if align is None:  # every test below needs a disk file system (ext4, xfs, ...) under tmp
        pytest.fail(f"{directory}: the file system reports no direct I/O alignment; run the "
                    "tests with a temporary directory on a disk")
    return align


def _buffer(n: int, shift: int, seed: int) -> memoryview:
    """``n`` bytes of pattern starting ``shift`` bytes past a page boundary of their memory."""
    raw = np.random.default_rng(seed).integers(0, 256, n + shift + 4096, dtype=np.uint8)
    base = -raw.__array_interface__["data"][0] % 4096
    return memoryview(raw[base + shift : base + shift + n])


def test_the_kernel_reports_this_disk_and_not_tmpfs(tmp_path):
    align = _direct_capable(str(tmp_path))
    assert align.memory >= 1 and align.step % 4096 == 0
    if os.path.isdir("/dev/shm"):
        fd = os.open(f"/dev/shm/bcp-probe-{os.getpid()}", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            assert direct_io.alignment(fd) is None  # tmpfs: its page cache is the file
        finally:
            os.close(fd)
            os.unlink(f"/dev/shm/bcp-probe-{os.getpid()}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=st.integers(0, 9000), shift=st.integers(0, 4095), size=st.integers(MiB - 5, 3 * MiB + 7),
       congruent=st.booleans(), seed=st.integers(0, 3))
def test_any_offset_and_address_write_the_exact_bytes(tmp_path, prefix, shift, size, congruent, seed):
    align = _direct_capable(str(tmp_path))
    if congruent:  # put the buffer where its address matches its file offset
        shift = (prefix - 0) % align.memory + (shift // align.memory) * align.memory
    data = _buffer(size, shift % 4096, seed)
    head = bytes(range(256)) * (prefix // 256) + bytes(prefix % 256)
    path = str(tmp_path / "f")
    writer = LocalStorage(fsync=True).open_writer(path)
    writer.write(head)
    writer.write(data)
    writer.write(b"tail")
    assert writer.commit() == prefix + size + 4
    with open(path, "rb") as f:
        got = f.read()
    assert got == head + bytes(data) + b"tail"
    span = direct_io.direct_span(data, prefix, align)
    assert writer.direct_bytes == (0 if span is None else span[1] - span[0])
    if congruent:
        assert writer.direct_bytes >= size - 2 * align.step - direct_io.MIN_DIRECT_BYTES
    elif (direct_io.address(data) - prefix) % align.memory:
        assert writer.direct_bytes == 0


def test_a_refused_direct_write_is_written_through_the_page_cache(tmp_path, monkeypatch):
    """A file system may accept the open and refuse the write (EINVAL): nothing is lost, the
    bytes go buffered, and the file writes no more direct."""
    _direct_capable(str(tmp_path))
    path = str(tmp_path / "f")
    writer = LocalStorage(fsync=True).open_writer(path)
    real = os.pwritev
    refused = []

    def pwritev(fd, views, offset):  # noqa: ANN001, ANN202
        if fd == writer._direct_fd:
            refused.append(offset)
            raise OSError(errno.EINVAL, "refused")
        return real(fd, views, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    blocks = [_buffer(2 * MiB, 0, s) for s in range(3)]
    for b in blocks:
        writer.write(b)
    writer.commit()
    assert refused and len(refused) == 1  # the first refusal ends direct writes
    assert writer.direct_bytes == 0 and writer.direct_alignment is None
    with open(path, "rb") as f:
        assert f.read() == b"".join(bytes(b) for b in blocks)


def test_a_failed_direct_write_fails_the_write(tmp_path, monkeypatch):
    """An I/O error is the disk's answer, not a refusal: it is raised, never papered over."""
    _direct_capable(str(tmp_path))
    writer = LocalStorage(fsync=True).open_writer(str(tmp_path / "f"))
    real = os.pwritev

    def pwritev(fd, views, offset):  # noqa: ANN001, ANN202
        if fd == writer._direct_fd:
            raise OSError(errno.EIO, "disk error")
        return real(fd, views, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    with pytest.raises(OSError, match="disk error"):
        writer.write(_buffer(2 * MiB, 0, 1))
    writer.abort()
    assert not os.path.exists(tmp_path / "f")


def test_a_file_renamed_over_the_path_is_never_written(tmp_path):
    """The direct descriptor is the writer's own file reopened through /proc: a file moved
    to the path after the writer opened it keeps its bytes."""
    _direct_capable(str(tmp_path))
    path = str(tmp_path / "f")
    writer = LocalStorage(fsync=True).open_writer(path)
    (tmp_path / "other").write_bytes(b"someone else's")
    os.replace(tmp_path / "other", path)
    writer.write(_buffer(2 * MiB, 0, 2))
    assert writer.direct_bytes > 0
    writer.abort()  # the writer's file is no longer at the path: abort leaves the path alone
    assert (tmp_path / "f").read_bytes() == b"someone else's"


def test_the_setting_and_tmpfs_turn_direct_writes_off(tmp_path, monkeypatch):
    _direct_capable(str(tmp_path))
    monkeypatch.setenv("BCP_STORAGE_DIRECT_WRITES", "0")
    writer = LocalStorage(fsync=False).open_writer(str(tmp_path / "f"))
    writer.write(_buffer(2 * MiB, 0, 0))
    writer.commit()
    assert writer.direct_alignment is None and writer.direct_bytes == 0
    monkeypatch.setenv("BCP_STORAGE_DIRECT_WRITES", "maybe")
    with pytest.raises(bcp.errors.StorageError, match="BCP_STORAGE_DIRECT_WRITES"):
        LocalStorage(fsync=False)
    monkeypatch.delenv("BCP_STORAGE_DIRECT_WRITES")
    if os.path.isdir("/dev/shm"):
        shm = SharedMemoryStorage()
        name = f"bcp-direct-{os.getpid()}"
        shm.makedirs("")  # its root: on a fresh machine no earlier test has made it
        writer = shm.open_writer(name)
        writer.write(_buffer(2 * MiB, 0, 0))
        writer.commit()
        shm.delete(name)
        assert writer.direct_bytes == 0


@contextlib.contextmanager
def _spooled(spool: Path) -> Iterator[list[dict]]:
    """Telemetry into ``spool`` for the block; the list fills with its ``storage.commit``
    events when the block ends."""
    import telemetry
    from telemetry import config
    from telemetry.context import reset_context
    from telemetry.emitter import DEFAULT_QUEUE_SIZE
    from telemetry.sinks import read_spool

    reset_context()
    telemetry.configure(spool_dir=spool, enabled=True, queue_size=DEFAULT_QUEUE_SIZE)
    commits: list[dict] = []
    try:
        yield commits
        telemetry.flush()
    finally:
        config.reset()
        reset_context()
    commits += [e for e in read_spool(spool) if e["name"] == "storage.commit"]


def _header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.one_of(st.integers(0, 300), st.integers(MiB, 2 * MiB + 100)),
                          st.integers(0, 63).map(lambda k: 64 * k), st.booleans()),
                min_size=1, max_size=6))
def test_large_pieces_land_where_their_memory_lies(tmp_path, pieces_spec):
    """A storage file laid out for direct writes: each large piece with a known address starts
    at that address modulo the alignment and is written (mostly) direct; the file is valid
    safetensors, every piece reads back exactly, padding is zeros under 4096 bytes, and the
    header check of version 4 accepts it, that of version 3 exactly when no padding reaches 64."""
    from safetensors import safe_open

    align = _direct_capable(str(tmp_path))
    bufs = [_buffer(n, shift, i) for i, (n, shift, _) in enumerate(pieces_spec)]
    pieces = [Piece(f"p{i}", "U8", (len(b),), len(b), lambda b=b: b,
                    address=direct_io.address(b) if known and len(b) else None)
              for i, (b, (_, _, known)) in enumerate(zip(bufs, pieces_spec))]
    path = str(tmp_path / "f.safetensors")
    storage = LocalStorage(fsync=False)
    size, written = write_file(storage, path, pieces, 4096, {"format": "bytecheckpoint"})
    data_start, _ = _header(path)
    with open(path, "rb") as fh:
        data = fh.read()
    memory = max(align.memory, DATA_ALIGN)
    assert data_start % memory == 0
    for piece, b, w in zip(pieces, bufs, written):
        assert data[w.byte_offset : w.byte_offset + w.byte_length] == bytes(b)
        if piece.address is not None and len(b) >= direct_io.MIN_DIRECT_BYTES:
            assert (w.byte_offset - piece.address) % memory == 0
        elif len(b) >= DATA_ALIGN:
            assert w.byte_offset % DATA_ALIGN == 0
    pads = []
    with safe_open(path, "pt") as f:
        for k in f.keys():
            if k.startswith(PADDING_PREFIX):
                t = f.get_tensor(k)
                assert 0 < t.numel() < DIRECT_PADDING and not t.any()
                pads.append(t.numel())
    expected = [(w.byte_offset, w.byte_offset + w.byte_length, "U8", (w.byte_length,), (p.name,))
                for w, p in zip(written, pieces)]
    directory, name = os.path.split(path)
    assert header_problem(storage, directory, name, size, expected, 1 << 20, padding_limit(4)) is None
    as_v3 = header_problem(storage, directory, name, size, expected, 1 << 20, padding_limit(3))
    assert (as_v3 is None) == all(p < DATA_ALIGN for p in pads)


def test_a_version_3_checkpoint_with_long_padding_is_refused_by_name(tmp_path, monkeypatch):
    """Version 3 wrote padding under 64 bytes: a longer one there means the file or the
    metadata was altered, and both verify and a verifying load say so."""
    from tests.fuzz import seal

    _direct_capable(str(tmp_path))
    monkeypatch.setenv("BCP_STORAGE_DIRECT_WRITES", "1")  # a synchronous save placed for direct writes
    model = torch.nn.Linear(512, 1024)
    # The weight's memory 256 bytes past a 512-byte boundary: it is placed there in the file,
    # behind 256 bytes of padding whatever precedes it (the 4 KiB bias or nothing).
    room = torch.empty(512 * 1024 + 1024)
    skip = (256 - room.data_ptr()) % 512 // 4
    weight = room[skip : skip + 512 * 1024].view(1024, 512)
    weight.copy_(model.weight.detach())
    model.weight = torch.nn.Parameter(weight)
    path = str(tmp_path / "c")
    bcp.save(path, {"model": model})
    _, header = _header(os.path.join(path, "model-00000.safetensors"))
    pads = [v["shape"][0] for k, v in header.items() if k.startswith(PADDING_PREFIX)]
    assert pads == [256]
    assert bcp.verify(path) == []
    meta_file = os.path.join(path, "metadata.msgpack")
    with open(meta_file, "rb") as fh:
        doc = seal.decode_doc(fh.read())
    assert doc["version"] == 4
    doc["version"] = 3
    with open(meta_file, "wb") as fh:
        fh.write(seal.encode_doc(doc))
    assert any("padding" in p for p in bcp.verify(path))
    with pytest.raises(bcp.errors.CorruptCheckpointError, match="padding"):
        bcp.load(path, {"model": torch.nn.Linear(512, 1024)})


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: writes from the pinned arena")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kw, setting", [({}, "1"), ({"async_save": True}, None),
                                         ({"async_save": True, "snapshot": "overlapped"}, None)])
def test_saves_write_direct_and_load_bit_exact(tmp_path, monkeypatch, kw, setting, device):
    """Staged and overlapped saves of large tensors write them direct (host tensors from their
    own memory, device tensors from the pinned arena), and synchronous ones with
    BCP_STORAGE_DIRECT_WRITES=1; each file's storage.commit event says how much."""
    _direct_capable(str(tmp_path))
    if setting is not None:
        monkeypatch.setenv("BCP_STORAGE_DIRECT_WRITES", setting)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 333)).to(device)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1024, device=device)).sum().backward()
    optim.step()
    with _spooled(tmp_path / "spool") as commits:
        result = bcp.save(str(tmp_path / "c"), {"model": model, "optimizer": optim}, **kw)
        if kw:
            result.wait()
    direct = sum(e["attrs"]["direct_bytes"] for e in commits)
    # 4 MiB weight + its 2 Adam moments, 1.3 MiB weight + 2 moments: all but heads and tails
    assert 3 * (4 + 1.3) * MiB - 6 * 2 * 4096 <= direct <= sum(e["attrs"]["file_bytes"] for e in commits)
    back = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 333)).to(device)
    back_optim = torch.optim.Adam(back.parameters())
    back(torch.randn(2, 1024, device=device)).sum().backward()
    back_optim.step()
    bcp.load(str(tmp_path / "c"), {"model": back, "optimizer": back_optim})
    for a, b in zip(model.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), back.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim.state[p][k], back_optim.state[q][k])
    assert bcp.verify(str(tmp_path / "c")) == []


@pytest.mark.parametrize("latency", [0.0, 0.01])
def test_the_optimizer_step_on_the_next_line_waits_for_direct_writes(tmp_path, latency):
    """The overlapped contract with direct writes: the step right after save() waits until the
    disk has every piece (the write is the snapshot), so the checkpoint is the state at save()
    bit for bit, though the step changes every tensor; with each write call slowed down, too."""
    from bytecheckpoint.engine import staging
    from bytecheckpoint.storage import faults

    _direct_capable(str(tmp_path))
    staging.release_pools()
    torch.manual_seed(1)
    model = torch.nn.Module()
    for i, n in enumerate([700_000, 5, 900_001, 600_000]):  # 2.8, 3.6 and 2.4 MB: placed, written direct
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(n)))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    ref = {**{k: v.clone() for k, v in model.state_dict().items()},
           **{f"{i}.{k}": v.clone() for i, p in enumerate(model.parameters())
              for k, v in optim.state[p].items()}}
    faults.install(f"latency_s={latency};ops=write;path={tmp_path}" if latency else None)
    try:
        with _spooled(tmp_path / "spool") as commits:
            handle = bcp.save(str(tmp_path / "c"), {"model": model, "optimizer": optim}, async_save=True,
                              snapshot="overlapped")
            optim.step()  # on the next line: must wait for the direct writes
            result = handle.wait(timeout=60)
    finally:
        faults.install(None)
    assert result.staging_bytes == 0  # written through, from the live tensors
    # the three large parameters and their two moments each (float32), less under a page at
    # each end of each of the 9 pieces
    direct = sum(e["attrs"]["direct_bytes"] for e in commits)
    assert direct >= 3 * 4 * (700_000 + 900_001 + 600_000) - 9 * 2 * 4096
    assert not torch.equal(model.p0, ref["p0"])  # the step did change the state
    back = torch.nn.Module()
    for i, n in enumerate([700_000, 5, 900_001, 600_000]):
        back.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(n)))
    back_optim = torch.optim.AdamW(back.parameters(), lr=0.1)
    for p in back.parameters():
        p.grad = torch.ones_like(p)
    back_optim.step()
    bcp.load(str(tmp_path / "c"), {"model": back, "optimizer": back_optim})
    got = {**back.state_dict(), **{f"{i}.{k}": v for i, p in enumerate(back.parameters())
                                   for k, v in back_optim.state[p].items()}}
    assert sorted(got) == sorted(ref)
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []


def test_a_synchronous_save_writes_through_the_page_cache_unless_told(tmp_path, monkeypatch):
    """BCP_STORAGE_DIRECT_WRITES=async (the default): a save training waits for writes nothing
    direct, and its commit events say how long each file waited for a host write slot; the
    checkpoint loads bit for bit."""
    _direct_capable(str(tmp_path))
    monkeypatch.setenv("BCP_STORAGE_SLOTS_DIR", str(tmp_path / "slots"))
    (tmp_path / "slots").mkdir()
    torch.manual_seed(2)
    model = torch.nn.Linear(1024, 3000)  # 12 MiB: past the slot threshold
    with _spooled(tmp_path / "spool") as commits:
        bcp.save(str(tmp_path / "c"), {"model": model})
    assert sum(e["attrs"]["direct_bytes"] for e in commits) == 0
    assert all(e["attrs"]["slot_wait_s"] >= 0 for e in commits) and commits
    assert os.listdir(tmp_path / "slots")  # the large file took a slot
    back = torch.nn.Linear(1024, 3000)
    bcp.load(str(tmp_path / "c"), {"model": back})
    assert torch.equal(back.weight, model.weight) and torch.equal(back.bias, model.bias)


@pytest.mark.parametrize("setting, direct, slots", [(None, False, 4), ("async", False, 4),
                                                    ("1", True, 4), ("0", False, 4)])
def test_waited_writes_take_the_page_cache_and_host_slots(monkeypatch, setting, direct, slots):
    from bytecheckpoint.storage import open_storage

    if setting is None:
        monkeypatch.delenv("BCP_STORAGE_DIRECT_WRITES", raising=False)
    else:
        monkeypatch.setenv("BCP_STORAGE_DIRECT_WRITES", setting)
    storage, _ = open_storage("/tmp/anything")
    waited = storage.for_waited_writes()
    assert waited.inner.transfer.direct_writes is direct
    assert waited.inner.host_writers == slots
    # the storage it came from is unchanged: async saves and everything else keep their own
    assert storage.inner.host_writers == 0
    assert storage.inner.transfer.direct_writes is (setting != "0")
    monkeypatch.setenv("BCP_STORAGE_HOST_WRITERS", "0")
    assert open_storage("/tmp/x")[0].for_waited_writes().inner.host_writers == 0
    if os.path.isdir("/dev/shm"):
        assert SharedMemoryStorage().for_waited_writes().host_writers == 0  # tmpfs: no disk
