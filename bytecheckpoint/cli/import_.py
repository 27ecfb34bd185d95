"""``bcp import SRC DST``: a Hugging Face safetensors directory as a checkpoint."""

from __future__ import annotations

import argparse

from ..errors import CheckpointError
from .common import (
    EXIT_OK,
    Adder,
    UsageError,
    count,
    human,
    location,
    print_json,
    progress,
)
from .export import names_of


def cmd_import(args: argparse.Namespace) -> int:
    from ..tools.export import ExportError, import_safetensors

    try:
        names = names_of(args)
        tie = None
        if args.tie:
            tie = {}
            for pair in args.tie:
                if "=" not in pair:
                    raise ExportError(f"--tie {pair!r} must look like NAME=SOURCE")
                k, v = pair.split("=", 1)
                tie[k] = v
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    with progress("reading", None, not args.quiet) as advance:
        result = import_safetensors(args.src, args.dst, model_key=args.model_key, names=names, tie=tie,
                                    step=args.step, overwrite=args.overwrite,
                                    progress=lambda _name, n: advance(n))
    if args.json:
        print_json({"path": result.path, "tensors": result.tensors, "bytes": result.bytes,
                     "tied": result.tied})
    else:
        print(f"imported {result.tensors} tensors ({human(result.bytes)}) into {result.path}")
        for k, v in result.tied.items():
            print(f"  tied: {k} = {v}")
    return EXIT_OK


def register(add: Adder) -> None:
    im = add("import", "write a Hugging Face safetensors directory as a checkpoint",
             "Read SRC (model.safetensors.index.json and its shards, or one model.safetensors; config.json "
             "when present) without unpickling anything, and save it at DST as a checkpoint of full "
             "tensors under the state key 'model', which bytecheckpoint.load reshards into any layout. "
             "The whole model is held in memory once.")
    im.add_argument("src", metavar="SRC", type=location, help="Hugging Face model directory")
    im.add_argument("dst", metavar="DST", type=location, help="checkpoint path to create (any storage URL)")
    im.add_argument("--model-key", default="model",
                    help="state key to store the tensors under (default 'model')")
    im.add_argument("--strip-prefix", action="append", metavar="PREFIX", help="as for export")
    im.add_argument("--rename", action="append", metavar="OLD=NEW", help="as for export")
    im.add_argument("--tie", action="append", metavar="NAME=SOURCE",
                    help="add NAME as a copy of SOURCE (default: the pairs the export recorded)")
    im.add_argument("--step", type=count(0), default=None, help="step recorded in the checkpoint")
    im.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    im.add_argument("--json", action="store_true", help="machine-readable summary")
    im.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    im.set_defaults(fn=cmd_import)
