"""``bcp verify PATH``: read every stored piece back and check its checksums."""

from __future__ import annotations

import argparse
import sys
import time

from .common import (
    EXIT_FAILED,
    EXIT_OK,
    Adder,
    count,
    human,
    location,
    print_json,
    progress,
    resolve_checkpoint,
)


def cmd_verify(args: argparse.Namespace) -> int:
    from ..commit.integrity import read_metadata, verify_files

    storage, path = resolve_checkpoint(args.path)
    total = sum(f.size for f in read_metadata(storage, path).files)
    t0 = time.perf_counter()
    with progress("verifying", total, not args.quiet) as advance:
        url, problems = verify_files(args.path, threads=args.threads, progress=advance)
    seconds = time.perf_counter() - t0
    bad = sorted({p.file for p in problems})
    if args.json:
        print_json({"path": url, "ok": not problems, "bad_files": bad,
                     "problems": [p.message for p in problems], "bytes": total, "seconds": round(seconds, 3)})
    elif problems:
        for p in problems:
            print(f"BAD  {p.file}: {p.message}")
        print(f"{url}: {len(bad)} bad file(s): {', '.join(bad)}", file=sys.stderr)
    else:
        print(f"OK   {url}: every checksum matches ({human(total)} in {seconds:.2f} s)")
    return EXIT_FAILED if problems else EXIT_OK


def register(add: Adder) -> None:
    ver = add("verify", "re-check every checksum of a checkpoint",
              "Read every stored piece back and check its checksums, in parallel. Prints each bad file and "
              "exits 1 when any is found (4 when the metadata itself is unreadable).")
    ver.add_argument("path", metavar="PATH", type=location)
    ver.add_argument("--threads", type=count(1), default=8, help="parallel readers (default 8)")
    ver.add_argument("--json", action="store_true", help="machine-readable output")
    ver.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ver.set_defaults(fn=cmd_verify)
