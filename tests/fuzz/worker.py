"""A fuzz worker process: runs cases in-process, answers over a private pipe.

``python -m tests.fuzz.worker WORKDIR PROGRESS_FILE``. Requests and answers are msgpack
frames (4-byte length + body) on the stdin and on a duplicate of the original stdout; the
real stdout goes to stderr so nothing a case prints can corrupt the protocol. Before each
case the worker writes the case's index into PROGRESS_FILE (an mmap, no system call), so a
parent that sees it die or stall knows which case did it.

Requests: ``["case", case]`` -> ``[kind, detail]``;
``["batch", target, seed, start, count]`` -> ``[counts, findings]`` (cases drawn here).
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import traceback
from typing import Any

import msgpack

_FRAME = struct.Struct("<I")


def read_frame(stream: Any) -> Any:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = _FRAME.unpack(head)
    return msgpack.unpackb(stream.read(n), raw=False, strict_map_key=False)


def write_frame(stream: Any, obj: Any) -> None:
    body = msgpack.packb(obj, use_bin_type=True, default=repr)
    stream.write(_FRAME.pack(len(body)) + body)
    stream.flush()


def main() -> int:
    workdir, progress_file = sys.argv[1], sys.argv[2]
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints from cases go to stderr
    sys.stdout = sys.stderr
    proto_in = sys.stdin.buffer
    from tests.fuzz import cases
    from tests.fuzz.outcomes import HARNESS, Result, Tally

    def attempt(make: Any) -> tuple[Any, Result]:
        case = None
        try:
            case = make()
            return case, cases.run(case, ctx)
        except Exception:  # noqa: BLE001 - a fuzzer bug is reported, not a dead worker
            return case, Result(HARNESS, traceback.format_exc()[-2000:])

    with open(progress_file, "r+b") as f:
        progress = mmap.mmap(f.fileno(), 8)
    ctx = cases.Context.create(workdir)
    write_frame(proto_out, ["ready"])
    while True:
        request = read_frame(proto_in)
        if request is None:
            return 0
        if request[0] == "case":
            progress[:8] = struct.pack("<q", 0)
            _, result = attempt(lambda case=request[1]: case)
            write_frame(proto_out, [result.kind, result.detail])
            continue
        _, target, seed, start, count = request
        tally = Tally()
        for i in range(start, start + count):
            progress[:8] = struct.pack("<q", i)
            rng = cases.case_rng(seed, target, i)
            case, result = attempt(lambda t=target, r=rng: cases.draw(t, r, ctx))
            tally.add(target, result, {"seed": seed, "index": i, "case": cases.describe(case)})
        write_frame(proto_out, [{f"{t}:{k}": n for (t, k), n in tally.counts.items()}, tally.findings])


if __name__ == "__main__":
    sys.exit(main())
