"""``bcp inspect PATH``: what a checkpoint holds, from its metadata alone."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from .common import (
    EXIT_OK,
    Adder,
    count,
    human,
    location,
    print_json,
    resolve_checkpoint,
    table,
)


def _inspect_doc(url: str) -> dict[str, Any]:
    import numpy as np

    from ..commit.integrity import read_metadata

    storage, path = resolve_checkpoint(url)
    meta = read_metadata(storage, path)
    counts = np.bincount(meta.boxes.tensor, minlength=len(meta.tensors)) if len(meta.tensors) else []
    tensors = [{"key": t.key, "shape": list(t.shape), "dtype": t.dtype, "boxes": int(n),
                "bytes": t.nbytes} for t, n in zip(meta.tensors, counts)]
    groups: dict[str, dict[str, int]] = {}
    for t in tensors:
        g = groups.setdefault(t["key"].split("/", 1)[0], {"tensors": 0, "bytes": 0})
        g["tensors"] += 1
        g["bytes"] += t["bytes"]
    return {
        "path": storage.url(path),
        "step": meta.step,
        "framework": meta.framework,
        "world_size": meta.world_size,
        "layout": meta.layout,
        "created_at": meta.created_at,
        "library_version": meta.library_version,
        "files": [{"name": f.name, "size": f.size, "rank": f.rank, "kind": f.kind} for f in meta.files],
        "total_bytes": meta.total_bytes,
        "groups": groups,
        "tensors": tensors,
        "boxes": len(meta.boxes),
        "objects": [{"key": o.key, "rank": o.rank, "bytes": o.bytes.byte_length} for o in meta.objects],
        "loader": meta.loader,
        "user_metadata": meta.user_metadata,
    }


def _when(timestamp: Any) -> str:
    """A metadata timestamp as a UTC date, or what is wrong with it (it may hold anything)."""
    if not timestamp:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(timestamp)))
    except (OverflowError, OSError, ValueError, TypeError):
        return f"invalid ({str(timestamp)[:40]})"


def cmd_inspect(args: argparse.Namespace) -> int:
    doc = _inspect_doc(args.path)
    if args.json:
        print_json(doc)
        return EXIT_OK
    created = _when(doc["created_at"])
    print(f"checkpoint  {doc['path']}")
    print(f"step        {doc['step']}")
    print(f"framework   {doc['framework']}   saved by {doc['world_size']} rank(s)   "
          f"layout {json.dumps(doc['layout'])}")
    print(f"created     {created}   library {doc['library_version']}")
    print(f"size        {human(doc['total_bytes'])} in {len(doc['files'])} files, "
          f"{len(doc['tensors'])} tensors, {doc['boxes']} boxes")
    print("groups      " + ", ".join(f"{g}: {v['tensors']} tensors, {human(v['bytes'])}"
                                     for g, v in doc["groups"].items()))
    print()
    shown = doc["tensors"] if args.all else doc["tensors"][: args.max_rows]
    print(table(["TENSOR", "SHAPE", "DTYPE", "BOXES"],
                 [[t["key"], "x".join(map(str, t["shape"])) or "()", t["dtype"], t["boxes"]] for t in shown]))
    if len(shown) < len(doc["tensors"]):
        print(f"... {len(doc['tensors']) - len(shown)} more (pass --all or --json)")
    print()
    per_rank = [o for o in doc["objects"] if o["rank"] is not None]
    shared = [o for o in doc["objects"] if o["rank"] is None]
    extra_keys = sorted({o["key"] for o in per_rank})
    print(f"extra state {len(extra_keys)} per-rank key(s): {', '.join(extra_keys) or '-'}; "
          f"{len(shared)} shared object(s)")
    loader = doc["loader"]
    print(f"dataloader  {len(loader)} entr{'y' if len(loader) == 1 else 'ies'}"
          + (f": {json.dumps(loader[0], default=str)[:200]}" if loader else ""))
    loader_objs = sorted({o["key"].split("/", 1)[0] for o in shared if "/" in o["key"]}
                         - {"model", "optimizer"})
    if loader_objs:
        print(f"            reshardable state: {', '.join(loader_objs)}")
    user = json.dumps(doc["user_metadata"], default=str)[:2000] if doc["user_metadata"] else "-"
    print(f"user meta   {user}")
    return EXIT_OK


def register(add: Adder) -> None:
    ins = add("inspect", "summarize a checkpoint's metadata",
              "Summarize a checkpoint from its metadata alone (no tensor bytes are read, nothing is "
              "unpickled): tensors (key, global shape, dtype, number of boxes), the saving layout, "
              "files, dataloader and extra state, user metadata. PATH is a checkpoint or a root with a "
              "'latest' pointer; any storage URL works.")
    ins.add_argument("path", metavar="PATH", type=location)
    ins.add_argument("--json", action="store_true", help="machine-readable output (every tensor)")
    ins.add_argument("--all", action="store_true", help="list every tensor")
    ins.add_argument("--max-rows", type=count(0), default=200,
                     help="tensors listed without --all (default 200)")
    ins.set_defaults(fn=cmd_inspect)
