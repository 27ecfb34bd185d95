"""``bcp convert``: PyTorch DCP / ``torch.save`` checkpoints into bytecheckpoint and back."""

from __future__ import annotations

import argparse
import sys

from ..errors import CheckpointError
from .common import (
    EXIT_OK,
    Adder,
    UsageError,
    human,
    location,
    print_json,
    progress,
)


def cmd_convert(args: argparse.Namespace) -> int:
    from ..tools import convert
    from ..tools.export import parse_size

    if (args.from_ is None) == (args.to is None):
        raise UsageError("give exactly one of --from dcp|torch (into bytecheckpoint) or --to dcp (out of it)")
    try:
        cap = parse_size(args.max_memory)
    except CheckpointError as exc:
        raise UsageError(f"--max-memory: {exc}") from None
    if cap < convert.MIN_MEMORY:
        raise UsageError(f"--max-memory {args.max_memory}: at least 1MiB")
    fn = {"dcp": convert.from_dcp, "torch": convert.from_torch}[args.from_] if args.from_ else convert.to_dcp
    with progress("converting", None, not args.quiet) as advance:
        result = fn(args.src, args.dst, max_memory=cap, overwrite=args.overwrite, progress=advance)
    if args.json:
        print_json({"path": result.path, "tensors": result.tensors, "bytes": result.bytes,
                     "skipped": result.skipped})
        return EXIT_OK
    print(f"converted {result.tensors} tensors ({human(result.bytes)}) into {result.path}")
    for s in result.skipped:
        print(f"  skipped: {s}", file=sys.stderr)
    return EXIT_OK


def register(add: Adder) -> None:
    cv = add("convert", "convert PyTorch DCP / torch.save checkpoints to bytecheckpoint and back",
             "--from dcp SRC DST: a DCP directory (.metadata + __N_M.distcp) into a checkpoint. "
             "--from torch FILE DST: a torch.save state dict (read with weights_only=True; anything "
             "else is refused). --to dcp SRC DST: a checkpoint into a DCP directory that "
             "torch.distributed.checkpoint.load reads. Into bytecheckpoint the bytes stream in blocks "
             "under --max-memory; out of it tensors are loaded whole in batches under it (one larger "
             "tensor is a batch of its own). Nothing is unpickled by the standard unpickler.")
    way = cv.add_mutually_exclusive_group(required=True)
    way.add_argument("--from", dest="from_", choices=["dcp", "torch"], help="the source format")
    way.add_argument("--to", choices=["dcp"], help="the output format (the source is a checkpoint)")
    cv.add_argument("src", metavar="SRC", type=location)
    cv.add_argument("dst", metavar="DST", type=location,
                    help="output (created; an existing one needs --overwrite)")
    cv.add_argument("--max-memory", default="1GiB", metavar="BYTES",
                    help="memory cap for tensor data, e.g. 16MiB, 2GB (default 1GiB; at least 1MiB)")
    cv.add_argument("--overwrite", action="store_true", help="replace DST")
    cv.add_argument("--json", action="store_true", help="machine-readable summary")
    cv.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    cv.set_defaults(fn=cmd_convert)
