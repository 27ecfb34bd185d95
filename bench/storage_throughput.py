"""Storage throughput on this machine: parallel ranged reads, and each backend's read/write.

Usage: python bench/storage_throughput.py [--gib 1] [--s3-mib 256] [--runs 3] [--dir /tmp]

1. Ranged read of one local file of ``--gib`` GiB into one buffer, with 1 thread and with
   4 threads (parts of 64 MiB), cold (the file's pages dropped from the page cache with
   posix_fadvise before each run; the read drops what it consumed, the library's default)
   and warm (already cached, read with ``drop_behind`` off so it stays cached).
2. Write then read of one file per backend through ``open_storage`` (retries and I/O
   events included): local disk (fsync at commit; the written pages are dropped, so the
   read comes from the disk), shm://, mem:// with ``--gib`` GiB, and
   S3 on a moto_server started here on 127.0.0.1 with ``--s3-mib`` MiB (moto is an
   emulator, so this measures moto and pyarrow on this machine, not AWS).

Prints the median of ``--runs`` runs in MB/s (10^6 bytes per second).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("BCP_TELEMETRY_DIR", tempfile.mkdtemp(prefix="bcp-bench-telemetry-"))

from bytecheckpoint.storage import open_storage  # noqa: E402
from bytecheckpoint.storage.config import TransferSettings  # noqa: E402
from bytecheckpoint.storage.local import LocalStorage  # noqa: E402

BLOCK = 16 << 20  # the engine hands writers 16 MiB blocks


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def _make_file(path: str, nbytes: int) -> None:
    block = os.urandom(BLOCK)
    with open(path, "wb") as f:
        for _ in range(nbytes // BLOCK):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ranged_read(directory: str, nbytes: int, runs: int) -> None:
    path = os.path.join(directory, f"bcp-bench-{uuid.uuid4().hex[:8]}")
    _make_file(path, nbytes)
    buf = bytearray(nbytes)
    try:
        print(f"ranged read of a {nbytes / 2**30:.2f} GiB local file into one buffer "
              f"(MB/s, median of {runs})")
        for cache in ("cold", "warm"):
            for threads in (1, 4):
                transfer = TransferSettings(part_bytes=64 << 20, threads=threads,
                                            drop_behind=cache == "cold")
                local = LocalStorage(fsync=False, transfer=transfer)
                rates = []
                for _ in range(runs):
                    if cache == "cold":
                        _drop_cache(path)
                    else:
                        local.read_into(path, 0, memoryview(buf))
                    t = time.perf_counter()
                    got = local.read_into(path, 0, memoryview(buf))
                    rates.append(_mbps(got, time.perf_counter() - t))
                    assert got == nbytes
                print(f"  {cache:4s} {threads} thread(s): {statistics.median(rates):8.0f}   "
                      f"runs: {', '.join(f'{r:.0f}' for r in rates)}")
    finally:
        os.unlink(path)


def backend_throughput(name: str, root: str, nbytes: int, runs: int) -> None:
    storage, base = open_storage(root)
    storage.makedirs(base)
    block = memoryview(os.urandom(BLOCK))
    buf = bytearray(nbytes)
    writes, reads = [], []
    for i in range(runs):
        path = f"{base}/f{i}"
        t = time.perf_counter()
        writer = storage.open_writer(path)
        for start in range(0, nbytes, BLOCK):
            writer.write(block[: min(BLOCK, nbytes - start)])
        writer.commit()
        writes.append(_mbps(nbytes, time.perf_counter() - t))
        t = time.perf_counter()
        assert storage.read_into(path, 0, memoryview(buf)) == nbytes
        reads.append(_mbps(nbytes, time.perf_counter() - t))
        storage.delete(path)
    storage.delete(base)
    print(f"  {name:24s} write {statistics.median(writes):7.0f}  read {statistics.median(reads):7.0f}   "
          f"(writes: {', '.join(f'{r:.0f}' for r in writes)}; reads: {', '.join(f'{r:.0f}' for r in reads)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--s3-mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30) // BLOCK * BLOCK
    ranged_read(args.dir, nbytes, args.runs)

    print(f"backend throughput through open_storage (MB/s, median of {args.runs}; 16 MiB writes, "
          "one read of the whole file)")
    tag = uuid.uuid4().hex[:8]
    backend_throughput(f"local disk ({nbytes >> 20} MiB)", os.path.join(args.dir, f"bcp-bench-{tag}"),
                       nbytes, args.runs)
    backend_throughput(f"shm:// ({nbytes >> 20} MiB)", f"shm://bcp-bench-{tag}", nbytes, args.runs)
    backend_throughput(f"mem:// ({nbytes >> 20} MiB)", f"mem://bcp-bench-{tag}", nbytes, args.runs)

    from tests.support.servers import S3_BUCKET, start_moto, stop_moto

    start_moto()
    try:
        backend_throughput(f"s3:// moto ({args.s3_mib} MiB)", f"s3://{S3_BUCKET}/{tag}", args.s3_mib << 20,
                           args.runs)
    finally:
        stop_moto()
    print("  hdfs://                  not measured: no HDFS cluster can run on this machine")


if __name__ == "__main__":
    main()
