"""``bcp export PATH OUT``: a checkpoint as Hugging Face safetensors shards."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..errors import CheckpointError
from .common import (
    EXIT_OK,
    Adder,
    UsageError,
    human,
    location,
    print_json,
    progress,
    resolve_checkpoint,
)


def names_of(args: argparse.Namespace) -> Any:
    from ..tools.export import NameMap

    return NameMap.parse(args.strip_prefix or (), args.rename or ())


def _check_export_target(url: str, out: str) -> None:
    """OUT must not be the checkpoint, inside it, or a directory holding it: replacing OUT
    (--overwrite) would delete the checkpoint, and writing into it would change it."""
    storage, path = resolve_checkpoint(url)
    if storage.scheme != "file":
        return
    ckpt, target = os.path.realpath(path), os.path.realpath(out)
    if os.path.commonpath([ckpt, target]) in (ckpt, target):
        raise UsageError(f"OUT {out} {'is' if ckpt == target else 'overlaps'} the checkpoint {ckpt}: "
                         "choose a directory outside it")


def cmd_export(args: argparse.Namespace) -> int:
    from ..tools.export import parse_dtype, parse_size, plan_export

    if args.format != "safetensors":
        raise UsageError(f"--format {args.format!r}: only safetensors is supported")
    try:
        from ..tools.export import export_safetensors
        limit = parse_size(args.max_shard_size)
        dtype = parse_dtype(args.dtype)
        names = names_of(args)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    _check_export_target(args.path, args.out)
    _, _, model, optim = plan_export(args.path, model_key=args.model_key,
                                     include_optimizer=args.include_optimizer, names=names, dtype=dtype)
    total = sum(it.out_bytes for it in model + optim)
    tied = None if args.tied is None else tuple(t for t in args.tied if t)
    with progress("exporting", total, not args.quiet) as advance:
        result = export_safetensors(
            args.path, args.out, max_shard_bytes=limit, dtype=dtype, names=names,
            include_optimizer=args.include_optimizer, model_key=args.model_key, config=args.config,
            tied=tied, overwrite=args.overwrite, progress=lambda _name, n: advance(n))
    if args.json:
        print_json({"out": result.out_dir, "files": result.files, "tensors": result.tensors,
                     "bytes": result.bytes, "tied": result.tied, "config": result.config_written})
        return EXIT_OK
    print(f"exported {result.tensors} tensors ({human(result.bytes)}) to {result.out_dir}")
    for f in result.files:
        print(f"  {f}")
    for dropped, kept in result.tied.items():
        print(f"  tied: {dropped} = {kept} (written once)")
    if not result.config_written:
        print("note: no config.json written (the checkpoint's user metadata has no 'hf_config'; "
              "pass --config)", file=sys.stderr)
    return EXIT_OK


def register(add: Adder) -> None:
    ex = add("export", "write a checkpoint as Hugging Face safetensors shards",
             "Merge a checkpoint's shards into full tensors and write OUT/model-0000k-of-0000n.safetensors "
             "with model.safetensors.index.json (and config.json), which transformers' from_pretrained "
             "loads. Streams: about one output shard is in memory at a time. Optimizer state "
             "(--include-optimizer) goes to optimizer-*.safetensors with its own index, named "
             "<parameter>.<state>, e.g. transformer.h.0.attn.c_attn.weight.exp_avg.")
    ex.add_argument("path", metavar="PATH", type=location,
                    help="checkpoint, or a root with a 'latest' pointer")
    ex.add_argument("out", metavar="OUT", type=location,
                    help="output directory (created; must be empty unless --overwrite)")
    ex.add_argument("--format", default="safetensors", choices=["safetensors"], help="output format")
    ex.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="largest output file, e.g. 2GB, 500MB, 1GiB (default 5GB); a bigger tensor gets a "
                         "file of its own")
    ex.add_argument("--dtype", default=None, metavar="DTYPE",
                    help="convert floating tensors: fp32, fp16, bf16, fp64 (default: as saved)")
    ex.add_argument("--strip-prefix", action="append", metavar="PREFIX",
                    help="remove PREFIX from names that start with it (repeatable; first match wins)")
    ex.add_argument("--rename", action="append", metavar="OLD=NEW",
                    help="regular-expression substitution on names, after --strip-prefix "
                         "(repeatable, applied in order)")
    ex.add_argument("--include-optimizer", action="store_true", help="also write optimizer state")
    ex.add_argument("--model-key", default="model", help="the state key of the model (default 'model')")
    ex.add_argument("--config", default=None, metavar="FILE",
                    help="config.json to copy in (default: the checkpoint's user metadata 'hf_config')")
    ex.add_argument("--tied", action="append", metavar="NAME",
                    help="a name written once when bit-identical to another tensor (repeatable; "
                         "default lm_head.weight unless the config sets tie_word_embeddings false; "
                         "--tied '' for none)")
    ex.add_argument("--overwrite", action="store_true", help="replace OUT")
    ex.add_argument("--json", action="store_true", help="machine-readable summary")
    ex.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ex.set_defaults(fn=cmd_export)
